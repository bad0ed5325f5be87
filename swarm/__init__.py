"""swarm: train one neural network on volunteers' machines, with no master node.

Public API (SPEC.md §3). Names are resolved lazily so that a DHT-only peer never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from swarm.core.version import __version__

_EXPORTS = {
    "Peer": "swarm.peer",
    "Identity": "swarm.core.identity",
    "SwarmError": "swarm.core.errors",
    "Averager": "swarm.averaging",
    "ExpertServer": "swarm.moe",
    "RemoteExpert": "swarm.moe",
    "RemoteMixtureOfExperts": "swarm.moe",
    "RemoteSwitchMixtureOfExperts": "swarm.moe",
    "Optimizer": "swarm.optim",
}

__all__ = [  # noqa: PLE0604 - the lazily resolved names above
    "__version__", *_EXPORTS,
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'swarm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
