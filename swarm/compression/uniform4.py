"""UNIFORM_4BIT: 16 evenly spaced levels between each block's minimum and maximum.

For low-bit outer gradients (DiLoCo's pseudo-gradients, which tolerate coarse rounding): with
only 16 levels one range per payload would spend them on a chunk's outliers, so the range is
kept per block of `BLOCK` (256) elements, which costs 0.25 bit per element on top of the 4.

Payload: header + one float32 minimum per block + one float32 step per block + the codes, two
per byte (the element at an even index in the low nibble). An element decodes to
`minimum + code * step` of its block, with `step = (maximum - minimum) / 15`; codes round to the
nearest level, so each element is within `step / 2` of its value (plus float32 rounding, a few
ulp of the block's largest magnitude). A constant block has step 0 and decodes exactly.
"""

from __future__ import annotations

import math

import torch

from swarm.compression._workspace import workspace
from swarm.compression.base import (
    HEADER_SIZE,
    Codec,
    CompressionError,
    CompressionType,
    PayloadHeader,
    value_range,
)

__all__ = ["BLOCK", "Uniform4BitQuantization"]

BLOCK = 256
_LEVELS = 15
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


class Uniform4BitQuantization(Codec):
    """UNIFORM_4BIT codec: blockwise min-max 4-bit quantization.

    `encode` raises CompressionError when the tensor holds NaN or ±inf, or when its values or a
    block's range exceed float32 (the ranges are stored and decoded in float32).
    """

    kind = CompressionType.UNIFORM_4BIT

    def _body_size(self, numel: int, dtype: torch.dtype) -> int:
        return 8 * _blocks(numel) + (numel + 1) // 2

    def _encode_body(self, flat: torch.Tensor, body: torch.Tensor) -> None:
        numel = flat.numel()
        if numel == 0:
            return
        low, high = value_range(flat)
        if not (math.isfinite(low) and math.isfinite(high)):
            raise CompressionError("UNIFORM_4BIT cannot encode a tensor holding NaN or inf")
        if max(-low, high) > _FLOAT32_MAX or high - low > _FLOAT32_MAX:
            raise CompressionError(
                f"UNIFORM_4BIT needs values and their range within float32; got [{low:.6g}, {high:.6g}]"
            )
        blocks = _blocks(numel)
        padded = workspace.get("uniform4", torch.float32, blocks * BLOCK)
        padded[:numel].copy_(flat)
        padded[numel:].fill_(padded[numel - 1].item())  # the last block's range stays its own
        grid = padded.view(blocks, BLOCK)
        ranges = body[: 8 * blocks].view(torch.float32).view(2, blocks)
        lows, steps = ranges[0], ranges[1]
        torch.amin(grid, dim=1, out=lows)
        torch.amax(grid, dim=1, out=steps)
        steps.sub_(lows).div_(_LEVELS)
        inverse = torch.where(steps > 0, steps.reciprocal(), torch.zeros_like(steps))
        # code = floor((x - low) / step + 1/2): the nearest level, clamped against float32 rounding
        grid.sub_(lows[:, None]).mul_(inverse[:, None]).add_(0.5)
        grid.nan_to_num_(nan=0.0).clamp_(0, _LEVELS)  # NaN: a value at its block's minimum times a
        # subnormal step's infinite inverse
        codes = workspace.get("uniform4-codes", torch.uint8, blocks * BLOCK)
        codes.copy_(padded)  # float -> uint8 truncates toward zero: floor for these values
        pairs = codes.view(-1, 2)
        packed = body[8 * blocks :]
        whole = numel // 2
        torch.bitwise_left_shift(pairs[:whole, 1], 4, out=packed[:whole])
        packed[:whole].bitwise_or_(pairs[:whole, 0])
        if numel % 2:
            packed[whole] = pairs[whole, 0]

    def _decode_body(
        self, payload: memoryview, header: PayloadHeader, out: torch.Tensor, weight: float | None
    ) -> None:
        numel = header.numel
        blocks = _blocks(numel)
        ranges = torch.frombuffer(payload, dtype=torch.float32, count=2 * blocks, offset=HEADER_SIZE).view(2, blocks)
        lows, steps = ranges[0], ranges[1]
        if not (bool(torch.isfinite(ranges).all()) and bool((steps >= 0).all())):
            raise CompressionError("UNIFORM_4BIT payload has an invalid block range (non-finite or negative step)")
        packed = torch.frombuffer(payload, dtype=torch.uint8, count=(numel + 1) // 2,
                                  offset=HEADER_SIZE + 8 * blocks)
        codes = workspace.get("uniform4-codes", torch.uint8, blocks * BLOCK)
        pairs = codes.view(-1, 2)
        whole = (numel + 1) // 2
        torch.bitwise_and(packed, 15, out=pairs[:whole, 0])
        torch.bitwise_right_shift(packed, 4, out=pairs[:whole, 1])
        values = workspace.get("uniform4", torch.float32, blocks * BLOCK)
        grid = values.view(blocks, BLOCK)
        values.copy_(codes)
        grid.mul_(steps[:, None]).add_(lows[:, None])
        decoded = values[:numel]
        if weight is None:
            out.copy_(decoded)
        else:
            out.add_(decoded, alpha=weight)
