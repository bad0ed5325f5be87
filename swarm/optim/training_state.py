"""A trainer's collaborative state as tensors plus a small msgpack-able description.

What a peer that falls behind or joins late downloads: the parameters, the optimizer's state
(Adam moments, step counts), the learning-rate scheduler and the epoch. Nested state dicts are
split into a flat list of tensors (streamed in ~1 MiB chunks) and a skeleton in which each
tensor is replaced by its index, so any torch optimizer or scheduler travels without a schema.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# what a state dict becomes once its tensors are taken out: plain msgpack-able values
Skeleton = dict[str, "Skeleton"] | list["Skeleton"] | bool | int | float | str | bytes | None

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"


def split_tensors(obj: object, tensors: list[torch.Tensor]) -> Skeleton:
    """Returns `obj` with every tensor replaced by `{"__tensor__": index}` (appended to `tensors`)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {_TENSOR: len(tensors) - 1}
    if isinstance(obj, dict):
        return {k: split_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {_TUPLE: [split_tensors(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [split_tensors(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    raise TypeError(f"cannot transfer a {type(obj).__name__} in a state dict")


def join_tensors(skeleton: object, tensors: Sequence[torch.Tensor]) -> object:
    """Inverse of `split_tensors`."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR}:
            index = skeleton[_TENSOR]
            if not isinstance(index, int) or not 0 <= index < len(tensors):
                raise ValueError(f"state skeleton names tensor {index!r} of {len(tensors)}")
            return tensors[index]
        if set(skeleton) == {_TUPLE}:
            return tuple(join_tensors(v, tensors) for v in skeleton[_TUPLE])
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_tensors(v, tensors) for v in skeleton]
    return skeleton


def state_digest(tensors: Sequence[torch.Tensor], max_elements: int = 1 << 16) -> str:
    """A short fingerprint of tensors' values: equal states give equal digests, diverged ones differ.

    Hashes at most `max_elements` evenly strided elements in all, so it costs microseconds even
    for large models; two groups that stepped apart differ nearly everywhere, so a sample sees it.
    """
    total = sum(t.numel() for t in tensors)
    stride = max(1, total // max_elements)
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        flat = t.detach().reshape(-1)[::stride].contiguous()
        h.update(flat.cpu().numpy().tobytes())
    return h.hexdigest()


@dataclass
class TrainingState:
    """A snapshot of what peers must agree on.

    Attributes:
        epoch: collective steps taken.
        params: parameter values, in the optimizer's order.
        optimizer: `optimizer.state_dict()` of the optimizer whose state travels (large-batch:
            the user's optimizer; DiLoCo: the outer optimizer).
        scheduler: `scheduler.state_dict()`, or None.
    """

    epoch: int
    params: list[torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None

    def to_wire(self) -> tuple[list[torch.Tensor], dict[str, Skeleton]]:
        """Flattens into (tensors, metadata); parameters come first."""
        tensors = list(self.params)
        skeleton = split_tensors({"optimizer": self.optimizer, "scheduler": self.scheduler}, tensors)
        return tensors, {"epoch": self.epoch, "num_params": len(self.params), "skeleton": skeleton}

    @classmethod
    def from_wire(cls, tensors: Sequence[torch.Tensor], metadata: object) -> TrainingState:
        """Rebuilds a snapshot; raises ValueError or TypeError on a malformed description."""
        metadata = metadata if isinstance(metadata, dict) else {}
        epoch, num_params, skeleton = metadata.get("epoch"), metadata.get("num_params"), metadata.get("skeleton")
        if not isinstance(epoch, int) or not isinstance(num_params, int) or not 0 <= num_params <= len(tensors):
            raise ValueError("state metadata lacks a valid epoch or parameter count")
        joined = join_tensors(skeleton, tensors)
        optimizer = joined.get("optimizer") if isinstance(joined, dict) else None
        if not isinstance(joined, dict) or not isinstance(optimizer, dict):
            raise TypeError("state metadata lacks the optimizer state")
        return cls(epoch, list(tensors[:num_params]), optimizer, joined.get("scheduler"))

    def clone(self) -> TrainingState:
        """A deep copy whose tensors no training step can change while it is being sent."""
        tensors, metadata = self.to_wire()
        return TrainingState.from_wire([t.detach().clone() for t in tensors], metadata)

    def check_compatible(self, params: Sequence[torch.Tensor]) -> None:
        """Raises ValueError unless the parameter shapes match this peer's (same model)."""
        if len(params) != len(self.params):
            raise ValueError(f"state holds {len(self.params)} parameters, this model has {len(params)}")
        for i, (mine, theirs) in enumerate(zip(params, self.params)):
            if mine.shape != theirs.shape:
                raise ValueError(f"parameter {i}: shape {tuple(theirs.shape)} in state, {tuple(mine.shape)} here")
