"""How the averaged vector is cut up: parts per reducer, chunks per stream message, flat views.

Pure tensor bookkeeping, no networking. Every member computes the same partition from the same
`GroupInfo`, so a part is identified by its index alone:

- `part_sizes` splits the flat vector among reducers in proportion to their declared bandwidth
  (largest-remainder rounding, so the sizes add up exactly and are deterministic);
- `chunk_bounds` cuts a part into stream messages of about `chunk_bytes` once encoded;
- `FlatTensors` shows a list of tensors of any shapes as one flat float32 vector, without copying
  contiguous float32 CPU tensors, and writes averaged ranges back.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence

import torch

AVERAGING_DTYPE = torch.float32


def part_sizes(numel: int, bandwidths: Sequence[float]) -> list[int]:
    """Splits `numel` elements among reducers in proportion to their bandwidths.

    Args:
        numel: length of the flat vector.
        bandwidths: one non-negative figure per reducer; if all are 0, parts are equal.

    Returns:
        One size per reducer, adding up to `numel`.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if not bandwidths:
        raise ValueError("need at least one reducer")
    weights = [float(b) for b in bandwidths]
    if any(not math.isfinite(b) or b < 0 for b in weights):
        raise ValueError(f"bandwidths must be finite and >= 0, got {list(bandwidths)}")
    total = sum(weights)
    if total <= 0:
        weights, total = [1.0] * len(weights), float(len(weights))
    exact = [numel * b / total for b in weights]
    sizes = [math.floor(x) for x in exact]
    remainder = numel - sum(sizes)
    # largest remainders first, ties broken by index: the same answer on every member
    order = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:remainder]:
        sizes[i] += 1
    return sizes


def part_offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each part in the flat vector (one more entry at the end: the total)."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


def chunk_bounds(size: int, chunk_numel: int) -> list[tuple[int, int]]:
    """Cuts `[0, size)` into consecutive `(start, end)` ranges of `chunk_numel` elements (last one shorter)."""
    if chunk_numel < 1:
        raise ValueError("chunk_numel must be >= 1")
    return [(start, min(start + chunk_numel, size)) for start in range(0, size, chunk_numel)]


def schema_digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """A digest of the tensors' shapes and dtypes: members with different schemas cannot average."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(f"{t.dtype!s}:{tuple(t.shape)};".encode())
    return h.digest()


def _pinned(t: torch.Tensor) -> bool:
    """Stage `t` in pinned (page-locked) host memory: it lives on a CUDA device, so copies to and
    from the stage are direct DMA transfers, without the driver's own staging copy."""
    return t.device.type == "cuda" and torch.cuda.is_available()


class FlatTensors:
    """A list of float tensors seen as one flat float32 vector.

    Contiguous float32 CPU tensors are used in place. Other tensors (float16/bfloat16/float64,
    strided, on another device) are staged in a float32 copy, refreshed by `refresh()` and written
    back by `write()`; float64 tensors are thus averaged in float32. A tensor on an accelerator
    (CUDA) is staged in pinned host memory, its one copy on the host: `refresh()` and `commit()`
    then wait for the device, so the averager calls them off the event loop (`on_device`).

    Args:
        tensors: floating-point tensors of any shapes.

    Raises:
        TypeError: a tensor is not floating point.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        for t in self.tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"expected torch tensors, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"only floating-point tensors can be averaged, got {t.dtype}")
        self._direct = [
            t.dtype == AVERAGING_DTYPE and t.device.type == "cpu" and t.is_contiguous() for t in self.tensors
        ]
        self.on_device = any(t.device.type != "cpu" for t in self.tensors)
        self._views: list[torch.Tensor] = [
            t.detach().view(-1) if direct else torch.empty(t.numel(), dtype=AVERAGING_DTYPE, pin_memory=_pinned(t))
            for t, direct in zip(self.tensors, self._direct)
        ]
        self.offsets = part_offsets([v.numel() for v in self._views])
        self.numel = self.offsets[-1]
        self._staging = torch.empty(0, dtype=AVERAGING_DTYPE)

    def refresh(self) -> None:
        """Copies the current values of staged (non-float32) tensors into their float32 views."""
        for t, view, direct in zip(self.tensors, self._views, self._direct):
            if not direct:
                view.copy_(t.detach().reshape(-1))

    def _segments(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(tensor index, start within it, end within it) covering the flat range [start, end)."""
        if not 0 <= start <= end <= self.numel:
            raise IndexError(f"range [{start}, {end}) outside a vector of {self.numel}")
        import bisect

        i = bisect.bisect_right(self.offsets, start) - 1
        pos = start
        while pos < end:
            while self.offsets[i + 1] <= pos:
                i += 1
            local_start = pos - self.offsets[i]
            local_end = min(end, self.offsets[i + 1]) - self.offsets[i]
            yield i, local_start, local_end
            pos = self.offsets[i] + local_end

    def read(self, start: int, end: int) -> torch.Tensor:
        """The values of [start, end): a view when inside one tensor, else a gathered copy
        (valid until the next `read` that spans tensors)."""
        segments = list(self._segments(start, end))
        if len(segments) == 1:
            i, a, b = segments[0]
            return self._views[i][a:b]
        if len(segments) == 0:
            return self._views[0][0:0] if self._views else torch.empty(0, dtype=AVERAGING_DTYPE)
        if self._staging.numel() < end - start:
            self._staging = torch.empty(end - start, dtype=AVERAGING_DTYPE)
        out = self._staging[: end - start]
        pos = 0
        for i, a, b in segments:
            out[pos:pos + b - a].copy_(self._views[i][a:b])
            pos += b - a
        return out

    def write(self, start: int, values: torch.Tensor) -> None:
        """Writes `values` over [start, start + len(values)) (into the float32 views only;
        call `commit()` to push staged tensors back)."""
        pos = 0
        for i, a, b in self._segments(start, start + values.numel()):
            self._views[i][a:b].copy_(values[pos:pos + b - a])
            pos += b - a

    def commit(self) -> None:
        """Copies staged float32 views back into the original non-float32 tensors."""
        with torch.no_grad():
            for t, view, direct in zip(self.tensors, self._views, self._direct):
                if not direct:
                    t.copy_(view.view(t.shape))

