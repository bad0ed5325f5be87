"""Optional dependencies: what a torch-free install can do, and the error where it cannot.

`pip install swarm-peer` is an infrastructure node (DHT/bootstrap, relay, `status`): it never
imports torch. Everything that holds tensors (averaging, compression, experts, the optimizer, the
demo) needs `pip install "swarm-peer[torch]"`; the packages that may import torch call
`require_torch` first, so that a missing torch is a `MissingDependency` naming that command, not a
bare ModuleNotFoundError. Which packages may import torch: docs/architecture.md, "What may import
torch" (checked by tests/test_torch_free.py).
"""

from __future__ import annotations

import importlib.util

from swarm.core.errors import MissingDependency

TORCH_INSTALL = 'pip install "swarm-peer[torch]"'
"""The one command that installs swarm with torch (a trainer's or an expert server's machine)."""


def torch_available() -> bool:
    """Whether torch can be imported here, without importing it."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def torch_missing(feature: str) -> MissingDependency:
    """The error for `feature` (what the user asked for) when torch is not installed."""
    return MissingDependency(
        f"{feature} needs torch, which is not installed: this is the infrastructure install of swarm "
        f"(DHT/bootstrap, relay, status). Install the full one with: {TORCH_INSTALL}"
    )


def require_torch(feature: str) -> None:
    """Raises `MissingDependency` naming the install command when torch is not installed."""
    if not torch_available():
        raise torch_missing(feature)
