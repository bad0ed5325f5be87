"""Codecs that keep values as floats: NONE (exact), FLOAT16 and SCALED_FLOAT16.

These are casts into the payload buffer, so they run near memory bandwidth (BENCHMARKS.md,
"Transport facts").

Non-finite values: NONE and FLOAT16 carry NaN and ±inf through unchanged, so that a caller can
detect them after averaging or refuse to send them first (`has_nonfinite`); SCALED_FLOAT16 is
lossy in a way that cannot represent them and refuses them.
"""

from __future__ import annotations

import math
import struct

import torch

from swarm.compression.base import (
    _DTYPE_TO_CODE,
    _HEADER,
    FORMAT_VERSION,
    HEADER_SIZE,
    Buffer,
    Codec,
    CompressionError,
    CompressionType,
    PayloadHeader,
    _flat_input,
    _write,
    value_range,
)

__all__ = ["Float16Compression", "NoCompression", "ScaledFloat16Compression", "has_nonfinite"]

# The smallest magnitude that rounds to infinity in float16 (halfway between 65504 and 2**16).
FLOAT16_OVERFLOW = 65520.0
# SCALED_FLOAT16 scales the largest magnitude into [2**14, 2**15): the top of float16's normal
# range, leaving headroom below 65504 and the most room above float16's smallest normal (2**-14).
_SCALED_TOP_EXPONENT = 15
_SCALE = struct.Struct("<d")


def has_nonfinite(tensor: torch.Tensor) -> bool:
    """Returns whether a tensor holds NaN or ±inf.

    NONE and FLOAT16 carry non-finite values through unchanged; a caller that must not spread
    them (an averager, an optimizer) checks its tensors with this before sending, or its result
    after decoding. Costs one read of the tensor (a min/max reduction).

    Args:
        tensor: a floating-point tensor of any shape.
    """
    if not tensor.is_floating_point():
        return False
    low, high = value_range(tensor.detach().reshape(-1))
    return not (math.isfinite(low) and math.isfinite(high))


class NoCompression(Codec):
    """NONE: the tensor's own dtype, bit for bit. Payload: header + raw elements."""

    kind = CompressionType.NONE

    def _body_size(self, numel: int, dtype: torch.dtype) -> int:
        return numel * dtype.itemsize

    def _encode_body(self, flat: torch.Tensor, body: torch.Tensor) -> None:
        body.view(flat.dtype).copy_(flat)

    def encode_views(self, tensor: torch.Tensor) -> tuple[Buffer, ...]:
        flat = _flat_input(tensor).contiguous()
        header = _HEADER.pack(int(self.kind), FORMAT_VERSION, _DTYPE_TO_CODE[flat.dtype], flat.numel())
        if flat.numel() == 0:
            return (header,)
        return header, flat.view(torch.uint8).numpy().data

    def _decode_body(
        self, payload: memoryview, header: PayloadHeader, out: torch.Tensor, weight: float | None
    ) -> None:
        values = torch.frombuffer(payload, dtype=header.dtype, count=header.numel, offset=HEADER_SIZE)
        if weight is None:
            out.copy_(values)
        else:
            out.add_(values, alpha=weight)


class Float16Compression(Codec):
    """FLOAT16: IEEE half precision. Payload: header + float16 elements.

    Relative error at most 2**-11 for magnitudes in float16's normal range (6.1e-5 to 65504);
    smaller magnitudes lose precision (absolute error up to 2**-25) and flush to zero below ~3e-8.
    `encode` raises CompressionError when a finite value would overflow to infinity (use
    SCALED_FLOAT16 for such tensors); NaN and ±inf pass through unchanged.
    """

    kind = CompressionType.FLOAT16

    def _body_size(self, numel: int, dtype: torch.dtype) -> int:
        return 2 * numel

    def _encode_body(self, flat: torch.Tensor, body: torch.Tensor) -> None:
        if flat.dtype != torch.float16 and flat.numel():
            _check_fits_float16(flat)
        body.view(torch.float16).copy_(flat)

    def _decode_body(
        self, payload: memoryview, header: PayloadHeader, out: torch.Tensor, weight: float | None
    ) -> None:
        values = torch.frombuffer(payload, dtype=torch.float16, count=header.numel, offset=HEADER_SIZE)
        if weight is None:
            out.copy_(values)
        else:
            out.add_(values, alpha=weight)


def _check_fits_float16(flat: torch.Tensor) -> None:
    low, high = value_range(flat)
    if math.isfinite(low) and math.isfinite(high):
        largest = max(-low, high)
        if largest >= FLOAT16_OVERFLOW:
            raise CompressionError(
                f"FLOAT16 cannot represent magnitude {largest:.6g} (float16 max is 65504); "
                "use SCALED_FLOAT16 for this tensor"
            )
        return
    # Rare path: NaN/inf present (they pass through); only a finite value out of range is an error.
    overflow = (flat.abs() >= FLOAT16_OVERFLOW) & torch.isfinite(flat)
    if bool(overflow.any()):
        largest = flat[overflow].abs().max().item()
        raise CompressionError(
            f"FLOAT16 cannot represent magnitude {largest:.6g} (float16 max is 65504); "
            "use SCALED_FLOAT16 for this tensor"
        )


class ScaledFloat16Compression(Codec):
    """SCALED_FLOAT16: half precision after scaling by a power of two.

    Payload: header + float64 scale + float16 elements (value = element * scale). The scale puts
    the chunk's largest magnitude M in [2**14, 2**15), so any finite range fits, and since scaling
    by a power of two is exact, every element is within 2**-11 * |x| of its value when |x| is at
    least M * 2**-28, and within M * 2**-39 below that: in all cases within 2**-11 * M.
    `encode` raises CompressionError on NaN or ±inf.
    """

    kind = CompressionType.SCALED_FLOAT16

    def _body_size(self, numel: int, dtype: torch.dtype) -> int:
        return _SCALE.size + 2 * numel

    def _encode_body(self, flat: torch.Tensor, body: torch.Tensor) -> None:
        low, high = value_range(flat)
        if not (math.isfinite(low) and math.isfinite(high)):
            raise CompressionError("SCALED_FLOAT16 cannot encode a tensor holding NaN or inf")
        exponent = power_of_two_exponent(max(-low, high), flat.dtype)
        _write(body, 0, _SCALE.pack(math.ldexp(1.0, -exponent)))
        torch.mul(flat, math.ldexp(1.0, exponent), out=body[_SCALE.size :].view(torch.float16))

    def _decode_body(
        self, payload: memoryview, header: PayloadHeader, out: torch.Tensor, weight: float | None
    ) -> None:
        (scale,) = _SCALE.unpack_from(payload, HEADER_SIZE)
        if not (math.isfinite(scale) and scale > 0):
            raise CompressionError(f"SCALED_FLOAT16 payload has an invalid scale {scale!r}")
        values = torch.frombuffer(
            payload, dtype=torch.float16, count=header.numel, offset=HEADER_SIZE + _SCALE.size
        )
        if weight is None:
            # Not torch.mul(values, scale, out=out): that would multiply in float16 and overflow.
            out.copy_(values)
            out.mul_(scale)
        else:
            out.add_(values, alpha=weight * scale)


def power_of_two_exponent(largest: float, dtype: torch.dtype) -> int:
    """Returns k such that `largest * 2**k` lies in [2**14, 2**15) (0 when `largest` is 0).

    k is clamped so that 2**k stays a normal number of the dtype the multiplication runs in
    (float32 for float32/float16/bfloat16 inputs); tensors that small simply keep fewer bits.
    """
    if largest == 0.0:
        return 0
    _, exponent = math.frexp(largest)  # largest = m * 2**exponent, 0.5 <= m < 1
    k = _SCALED_TOP_EXPONENT - exponent
    limit = 1000 if dtype == torch.float64 else 126
    return max(-limit, min(limit, k))
