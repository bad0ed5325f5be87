"""Collaboration settings for the integrations' tests."""

from dataclasses import replace

from swarm.compression import CompressionType
from swarm.optim import CollaborationConfig

# every round waited for (max_staleness 0), so the peers stop at the same collective step; reports
# and reads frequent, so a few-second run takes many steps
FAST = CollaborationConfig(report_period=0.05, min_refresh_period=0.02, max_refresh_period=0.2, averaging_timeout=10.0,
                           max_staleness=0, gradient_compression=CompressionType.NONE)

# for a run in which a peer dies: its report stops counting after 2 s, a round it leaves fails in 4 s
RESTART = replace(FAST, progress_expiration=2.0, averaging_timeout=4.0, state_timeout=20.0)
