"""TensorSchema: the shape (without the batch dimension) and dtype one expert argument must have."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from swarm.core.errors import InvalidRequest

__all__ = ["TensorSchema", "dtype_name"]


@dataclass(frozen=True)
class TensorSchema:
    """The shape (without the batch dimension) and dtype that one tensor argument must have.

    Attributes:
        shape_without_batch: the shape of one row, e.g. ``(1024,)`` for a ``(batch, 1024)`` input.
        dtype: the exact dtype, e.g. ``torch.float32``.
    """

    shape_without_batch: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        shape = tuple(self.shape_without_batch)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise ValueError(f"shape_without_batch must hold non-negative ints, got {shape!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "shape_without_batch", shape)

    @classmethod
    def like(cls, tensor: torch.Tensor) -> TensorSchema:
        """Builds the schema of a batched sample tensor (its first dimension is the batch)."""
        if tensor.dim() < 1:
            raise ValueError("a sample tensor needs a leading batch dimension")
        return cls(tuple(tensor.shape[1:]), tensor.dtype)

    def validate(
        self, tensor: object, max_batch: int, *, check_finite: bool = True, what: str = "tensor"
    ) -> None:
        """Checks that `tensor` is a batch this schema accepts.

        Args:
            tensor: the candidate batch, shape ``(batch, *shape_without_batch)``.
            max_batch: the largest batch size accepted.
            check_finite: also reject NaN and infinite values (a full pass over the data).
            what: how error messages name the tensor, e.g. ``"input 0 of ffn.0.0"``.

        Raises:
            InvalidRequest: not a tensor, wrong dtype or shape, an empty or too large batch,
                or (with `check_finite`) NaN/Inf values.
        """
        if not isinstance(tensor, torch.Tensor):
            raise InvalidRequest(f"{what}: expected a tensor, got {type(tensor).__name__}")
        if tensor.dtype != self.dtype:
            raise InvalidRequest(
                f"{what}: expected dtype {dtype_name(self.dtype)}, got {dtype_name(tensor.dtype)}"
            )
        expected = ("batch", *self.shape_without_batch)
        if tensor.dim() != len(expected) or tuple(tensor.shape[1:]) != self.shape_without_batch:
            raise InvalidRequest(
                f"{what}: expected shape ({', '.join(map(str, expected))}), got {tuple(tensor.shape)}"
            )
        batch = tensor.shape[0]
        if batch < 1:
            raise InvalidRequest(f"{what}: the batch is empty")
        if batch > max_batch:
            raise InvalidRequest(f"{what}: batch of {batch} rows exceeds the limit of {max_batch}")
        inexact = tensor.is_floating_point() or tensor.is_complex()
        if check_finite and inexact and not _all_finite(tensor):
            raise InvalidRequest(f"{what}: contains NaN or infinite values")

    def to_dict(self) -> dict[str, Any]:
        """Returns a msgpack-friendly form: ``{"shape": [...], "dtype": "float32"}``."""
        return {"shape": list(self.shape_without_batch), "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorSchema:
        """Parses the form `to_dict` produces.

        Raises:
            ValueError: the dict is malformed or names an unknown dtype.
        """
        try:
            shape, name = data["shape"], data["dtype"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed tensor schema {data!r}") from e
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {name!r} in tensor schema")  # noqa: TRY004 - bad value
        if not isinstance(shape, (list, tuple)):
            raise ValueError(f"malformed shape {shape!r} in tensor schema")  # noqa: TRY004 - bad value
        return cls(tuple(shape), dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """Returns the short name of a dtype, e.g. ``"float32"`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def _all_finite(tensor: torch.Tensor) -> bool:
    # A NaN or infinity anywhere makes the sum non-finite, so a finite sum proves every element is
    # finite at the cost of one reduction (~10x cheaper than isfinite().all(), which allocates a
    # mask). A non-finite sum may be an overflow of large finite values: check exactly then.
    # numpy where it can: its reductions are single-threaded, and this runs on the event loop,
    # where torch's intra-op thread pool would contend with the compute thread (BENCHMARKS.md,
    # "Measurements behind design choices").
    if tensor.device.type == "cpu" and tensor.dtype in _NUMPY_FLOATS:
        array = tensor.detach().numpy()
        with np.errstate(over="ignore", invalid="ignore"):
            return bool(np.isfinite(array.sum())) or bool(np.isfinite(array).all())
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
