"""Collaborative training on top of averaging: `swarm.Optimizer` and its configuration (docs/architecture.md).

Names are resolved lazily, as in `swarm.moe`, so that reading progress records
(`swarm.optim.progress`, `swarm.optim.tracker`: what a dashboard does) does not import torch; the
names that need torch raise `MissingDependency` naming the install command where it is missing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from swarm.core.optional import require_torch

if TYPE_CHECKING:
    from swarm.optim.checkpointing import CheckpointConfig
    from swarm.optim.config import CollaborationConfig, DiLoCoConfig
    from swarm.optim.optimizer import Optimizer
    from swarm.optim.outcome import RoundOutcome, StepOutcome
    from swarm.optim.progress import PeerProgress, SwarmProgress

_EXPORTS = {
    "CheckpointConfig": "swarm.optim.checkpointing",
    "CollaborationConfig": "swarm.optim.config",
    "DiLoCoConfig": "swarm.optim.config",
    "Optimizer": "swarm.optim.optimizer",
    "PeerProgress": "swarm.optim.progress",
    "RoundOutcome": "swarm.optim.outcome",
    "StepOutcome": "swarm.optim.outcome",
    "SwarmProgress": "swarm.optim.progress",
}

__all__ = ["CheckpointConfig", "CollaborationConfig", "DiLoCoConfig", "Optimizer", "PeerProgress", "RoundOutcome", "StepOutcome",
           "SwarmProgress"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'swarm.optim' has no attribute {name!r}")
    if module != "swarm.optim.progress":
        require_torch(f"swarm.optim.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
