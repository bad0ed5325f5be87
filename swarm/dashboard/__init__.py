"""The swarm's live web page, served by any peer from what the swarm itself holds (docs/operations.md,
"Dashboard").

`view` builds the picture as plain data (pure), `collector` reads it from DHT records and peers'
`Info` answers, `server` serves the page and its live updates (the optional `dashboard` extra:
Starlette and uvicorn), `service` attaches all of it to a running peer.
"""

from swarm.dashboard.collector import Collector, DashboardConfig
from swarm.dashboard.view import DashboardLimits

__all__ = ["Collector", "DashboardConfig", "DashboardLimits"]
