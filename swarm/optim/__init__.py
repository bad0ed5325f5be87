"""Collaborative training on top of averaging: `swarm.Optimizer` and its configuration (docs/architecture.md)."""

from swarm.optim.checkpointing import CheckpointConfig
from swarm.optim.config import CollaborationConfig, DiLoCoConfig
from swarm.optim.optimizer import Optimizer
from swarm.optim.outcome import RoundOutcome, StepOutcome
from swarm.optim.progress import PeerProgress, SwarmProgress

__all__ = ["CheckpointConfig", "CollaborationConfig", "DiLoCoConfig", "Optimizer", "PeerProgress", "RoundOutcome", "StepOutcome",
           "SwarmProgress"]
