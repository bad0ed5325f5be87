"""swarm.testing: a network lab on one machine (hosts as network namespaces with latency,
bandwidth, loss, NAT and partitions) and a scenario runner with process faults.

See docs/network-lab.md. `python -m swarm.testing SCENARIO.toml` runs a scenario.
"""

from swarm.testing.lab import HostSpec, Lab, LinkProfile
from swarm.testing.netns import LabError, clean_stale, missing_requirements

__all__ = ["HostSpec", "Lab", "LabError", "LinkProfile", "clean_stale", "missing_requirements"]
