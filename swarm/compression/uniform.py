"""UNIFORM_8BIT: 256 evenly spaced levels between a chunk's minimum and maximum.

Payload: header + float64 minimum + float64 step + one uint8 code per element; an element decodes
to `minimum + code * step`, with `step = (maximum - minimum) / 255`. Codes round to the nearest
level, so each element is within `step / 2` of its value (plus float32 rounding of the decoded
sum, a few ulp of the largest magnitude). A constant chunk has step 0 and decodes exactly.

The work is three float32 passes over the chunk (subtract, multiply, narrow to uint8) in reused
scratch buffers (speeds: BENCHMARKS.md, "Transport facts").
"""

from __future__ import annotations

import math
import struct

import torch

from swarm.compression._workspace import workspace
from swarm.compression.base import (
    HEADER_SIZE,
    Codec,
    CompressionError,
    CompressionType,
    PayloadHeader,
    _write,
    value_range,
)

__all__ = ["Uniform8BitQuantization"]

_RANGE = struct.Struct("<dd")
_LEVELS = 255
_FLOAT32_MAX = torch.finfo(torch.float32).max
# Elements are processed in pieces of this many, so the float32 scratch stays bounded (4 MiB)
# however large a tensor is encoded as one payload.
_PIECE = 1 << 20


def _float32_ulp(magnitude: float) -> float:
    return math.ldexp(1.0, math.frexp(magnitude)[1] - 24) if magnitude else 0.0


class Uniform8BitQuantization(Codec):
    """UNIFORM_8BIT codec: min-max 8-bit quantization with one range per payload.

    `encode` raises CompressionError when the tensor holds NaN or ±inf, or when its values or
    their range exceed float32 (decoding computes in float32).
    """

    kind = CompressionType.UNIFORM_8BIT

    def _body_size(self, numel: int, dtype: torch.dtype) -> int:
        return _RANGE.size + numel

    def _encode_body(self, flat: torch.Tensor, body: torch.Tensor) -> None:
        low, high = value_range(flat)
        if not (math.isfinite(low) and math.isfinite(high)):
            raise CompressionError("UNIFORM_8BIT cannot encode a tensor holding NaN or inf")
        if max(-low, high) > _FLOAT32_MAX or high - low > _FLOAT32_MAX:
            raise CompressionError(
                f"UNIFORM_8BIT needs values and their range within float32; got [{low:.6g}, {high:.6g}]"
            )
        step = (high - low) / _LEVELS
        inverse = 1.0 / step if step else 0.0
        _write(body, 0, _RANGE.pack(low, step))
        codes = body[_RANGE.size :]
        # code = floor((x - (low - step/2)) / step): round to the nearest level, in [0, 255].
        shift = low - step / 2 if step else low
        # Float32 arithmetic keeps codes in [0, 255] unless the range is tiny next to the values'
        # magnitude (ulp(x) / step large) or the step is nearly subnormal; then compute in float64
        # and clamp, which is slower but exact enough.
        careful = inverse > 1e30 or _float32_ulp(max(-low, high)) * inverse > 0.125
        for start in range(0, flat.numel(), _PIECE):
            piece = flat[start : start + _PIECE]
            out = codes[start : start + _PIECE]
            if careful:
                scaled = (piece.to(torch.float64) - shift).mul_(inverse).clamp_(0, _LEVELS)
            else:
                scaled = workspace.get("uniform8", torch.float32, piece.numel())
                if piece.dtype in (torch.float16, torch.bfloat16):
                    # Subtract in float32: in half precision (x - shift) would round.
                    scaled.copy_(piece)
                    piece = scaled
                torch.sub(piece, shift, out=scaled)
                scaled.mul_(inverse)
            out.copy_(scaled)  # float -> uint8 truncates toward zero: floor for these values

    def _decode_body(
        self, payload: memoryview, header: PayloadHeader, out: torch.Tensor, weight: float | None
    ) -> None:
        low, step = _RANGE.unpack_from(payload, HEADER_SIZE)
        if not (math.isfinite(low) and math.isfinite(step) and step >= 0):
            raise CompressionError(f"UNIFORM_8BIT payload has an invalid range (min {low!r}, step {step!r})")
        codes = torch.frombuffer(
            payload, dtype=torch.uint8, count=header.numel, offset=HEADER_SIZE + _RANGE.size
        )
        if out.dtype in (torch.float32, torch.float64):
            if weight is None:
                torch.mul(codes, step, out=out)
                out.add_(low)
            else:
                out.add_(codes, alpha=weight * step)
                out.add_(weight * low)
            return
        # float16/bfloat16 accumulators: decode in float32 first, so that `out` is rounded once.
        for start in range(0, header.numel, _PIECE):
            piece = codes[start : start + _PIECE]
            values = workspace.get("uniform8", torch.float32, piece.numel())
            torch.mul(piece, step, out=values)
            values.add_(low)
            if weight is None:
                out[start : start + _PIECE].copy_(values)
            else:
                out[start : start + _PIECE].add_(values, alpha=weight)
