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


TORCH_EXTRA = ("torch", "numpy")
"""The packages the torch extra adds (numpy: the expert wire's row maps, tensors' raw bytes)."""


def _missing() -> list[str]:
    missing = []
    for name in TORCH_EXTRA:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def torch_available() -> bool:
    """Whether torch and numpy (the torch extra) can be imported here, without importing them."""
    return not _missing()


def torch_missing(feature: str) -> MissingDependency:
    """The error for `feature` (what the user asked for) when the torch extra is not installed."""
    missing = " and ".join(_missing()) or "torch"
    return MissingDependency(
        f"{feature} needs {missing}, which is not installed: this is the infrastructure install of swarm "
        f"(DHT/bootstrap, relay, status). Install the full one with: {TORCH_INSTALL}"
    )


def require_torch(feature: str) -> None:
    """Raises `MissingDependency` naming the install command when torch or numpy is not installed."""
    if not torch_available():
        raise torch_missing(feature)
