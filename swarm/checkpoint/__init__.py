"""A run's checkpoints on disk: the format (`format`), a directory of them (`store`), their errors.

Pure: imports neither torch nor the network, so archivers, `swarm-peer export` and tools use it
alone; `swarm.optim.checkpointing` turns a trainer's state into it and back (docs/operations.md,
"Checkpoints and a cold restart").
"""

from swarm.checkpoint.errors import (
           CheckpointInvalid,
           CheckpointNotFound,
           CheckpointRefused,
           RunCheckpointError,
)
from swarm.checkpoint.format import FORMAT_VERSION, Manifest, ParamSpec, RawTensor
from swarm.checkpoint.store import Checkpoint, CheckpointStore

__all__ = ["FORMAT_VERSION", "Checkpoint", "CheckpointInvalid", "CheckpointNotFound", "CheckpointRefused",
           "CheckpointStore", "Manifest", "ParamSpec", "RawTensor", "RunCheckpointError"]
