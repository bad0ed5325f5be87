"""Collaborative training on top of averaging: `swarm.Optimizer` and its configuration (docs/architecture.md)."""

import swarm.core.needs_torch  # noqa: F401  (first: without torch, an error naming the install command)
from swarm.optim.config import CollaborationConfig, DiLoCoConfig
from swarm.optim.optimizer import Optimizer
from swarm.optim.outcome import RoundOutcome, StepOutcome
from swarm.optim.progress import PeerProgress, SwarmProgress

__all__ = ["CollaborationConfig", "DiLoCoConfig", "Optimizer", "PeerProgress", "RoundOutcome", "StepOutcome",
           "SwarmProgress"]
