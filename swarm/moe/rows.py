"""Row gathers and scatters of CPU tensors, run on the calling thread alone (numpy).

A mixture's client and an expert server's event loop move rows between tensors: a share of a
batch for each expert, outputs into their (sample, slot) places, gradients summed over experts.
Torch runs such copies on its intra-op thread pool, and a parallel region waits for all its
threads: on a busy 2-core machine, where a second thread is often descheduled, gathers and
index_add_ take many times longer (BENCHMARKS.md, "Measurements behind design choices"), and on a
server's event loop they would contend with the compute threads. numpy does the same on one thread. Dtypes numpy lacks
(bfloat16) and non-CPU tensors fall back to torch.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["add_", "add_rows_", "put_pairs_", "take_pairs", "take_rows", "zeros"]


def _array(tensor: torch.Tensor) -> np.ndarray | None:
    if tensor.device.type != "cpu" or tensor.dtype == torch.bfloat16 or tensor.is_complex():
        return None
    return tensor.detach().numpy()


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor (numpy's calloc: pages are zeroed lazily by the kernel, on first touch)."""
    if dtype == torch.bfloat16 or dtype.is_complex:
        return torch.zeros(shape, dtype=dtype)
    return torch.from_numpy(np.zeros(shape, dtype=torch.empty((), dtype=dtype).numpy().dtype))


def take_rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``tensor[rows]``, a new tensor."""
    array, index = _array(tensor), _array(rows)
    if array is None or index is None:
        return tensor[rows]
    return torch.from_numpy(np.take(array, index, axis=0))


def take_pairs(tensor: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``tensor[rows, cols]``, a new tensor (one row per (row, col) pair)."""
    array, r, c = _array(tensor), _array(rows), _array(cols)
    if array is None or r is None or c is None:
        return tensor[rows, cols]
    return torch.from_numpy(array[r, c])


def put_pairs_(dst: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[rows, cols] = src`` in place."""
    array, r, c, values = _array(dst), _array(rows), _array(cols), _array(src)
    if array is None or r is None or c is None or values is None:
        dst[rows, cols] = src.to(dst.dtype)
        return
    array[r, c] = values


def add_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` in place."""
    array, values = _array(dst), _array(src)
    if array is None or values is None:
        dst.add_(src.to(dst.dtype))
        return
    np.add(array, values, out=array, casting="unsafe")


def add_rows_(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[rows] += src`` in place; `rows` must not repeat an index."""
    array, index, values = _array(dst), _array(rows), _array(src)
    if array is None or index is None or values is None:
        dst.index_add_(0, rows, src.to(dst.dtype))
        return
    array[index] += values
