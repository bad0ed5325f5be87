"""Why a run's checkpoint could not be used: it is damaged, it is not this run's, or there is none."""

from __future__ import annotations

from swarm.core.errors import SwarmError


class RunCheckpointError(SwarmError):
    """A run's checkpoint could not be read or used."""


class CheckpointInvalid(RunCheckpointError):
    """A checkpoint is truncated or corrupted (a digest, a size, the manifest or the tensors file is
    wrong): a reader moves on to the next older one."""


class CheckpointRefused(RunCheckpointError):
    """A well-formed checkpoint that must not be loaded here: another run, another model (names,
    shapes or dtypes of the parameters differ) or a newer format version. The message says which."""


class CheckpointNotFound(RunCheckpointError):
    """No usable checkpoint in a directory."""
