"""Encoding and decoding by compression type: the entry points the averager and MoE call.

A payload's first byte names its CompressionType, so `decode` and `decode_add` need no type
from the caller: a reducer feeds them whatever chunks arrive.
"""

from __future__ import annotations

import torch

from swarm.compression.base import Buffer, Codec, CompressionError, CompressionType, read_header
from swarm.compression.floating import Float16Compression, NoCompression, ScaledFloat16Compression
from swarm.compression.quantile import Quantile8BitQuantization
from swarm.compression.uniform import Uniform8BitQuantization
from swarm.compression.uniform4 import Uniform4BitQuantization

__all__ = ["decode", "decode_add", "encode", "get_codec"]

_CODECS: dict[CompressionType, Codec] = {
    codec.kind: codec
    for codec in (
        NoCompression(),
        Float16Compression(),
        ScaledFloat16Compression(),
        Uniform8BitQuantization(),
        Quantile8BitQuantization(),
        Uniform4BitQuantization(),
    )
}


def get_codec(kind: CompressionType | int) -> Codec:
    """Returns the shared codec for a compression type.

    Args:
        kind: a CompressionType or its integer value.

    Raises:
        CompressionError: `kind` names no known compression type.
    """
    try:
        return _CODECS[CompressionType(kind)]
    except (ValueError, KeyError):
        raise CompressionError(f"unknown compression type {kind!r}") from None


def encode(tensor: torch.Tensor, kind: CompressionType | int = CompressionType.NONE) -> bytes:
    """Encodes a tensor (normally one chunk) as a self-contained payload of the given type.

    Args:
        tensor: float32, float16, bfloat16 or float64, any shape (flattened).
        kind: how to encode it.

    Returns:
        The payload; its first byte is `kind`.

    Raises:
        TypeError: unsupported dtype.
        CompressionError: unknown `kind`, or values the codec cannot represent (NaN/inf for the
            lossy types, float16 overflow for FLOAT16).
    """
    return get_codec(kind).encode(tensor)


def decode(payload: Buffer, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decodes a payload of any compression type.

    Args:
        payload: bytes made by `encode` (or any codec's `encode`).
        out: tensor to overwrite, with exactly the payload's number of elements; when None, a new
            1-D tensor of the encoded tensor's dtype is allocated.

    Returns:
        `out`, or the new tensor.

    Raises:
        CompressionError: the payload is malformed (truncated, wrong length, unknown type or
            version) or holds a different number of elements than `out`.
        TypeError: `out` is not a floating-point tensor.
    """
    codec = _CODECS[read_header(payload).kind]
    if out is None:
        header = codec.check_payload(payload)  # before allocating what the header claims
        out = torch.empty(header.numel, dtype=header.dtype)
    codec.decode(payload, out)
    return out


def decode_add(payload: Buffer, out: torch.Tensor, weight: float = 1.0) -> None:
    """Adds `weight * decoded` into `out`, for a payload of any compression type.

    Args:
        payload: bytes made by `encode`.
        out: the accumulator, with exactly the payload's number of elements.
        weight: finite multiplier for the decoded values.

    Raises:
        CompressionError: as for `decode`.
        TypeError: `out` is not a floating-point tensor.
        ValueError: `weight` is not finite.
    """
    _CODECS[read_header(payload).kind].decode_add(payload, out, weight)
