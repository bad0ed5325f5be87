"""The payload format and the base class every codec shares.

A payload is the self-contained encoding of one chunk of a flat float tensor. Every payload
starts with the same 16-byte header, so a receiver can decode any payload without being told
how it was made:

    offset  size  field
    0       1     CompressionType
    1       1     format version (currently 1)
    2       1     dtype code of the tensor that was encoded (float32, float16, bfloat16, float64)
    3       5     reserved, zero
    8       8     numel, unsigned little-endian
    16      ...   codec-specific body (scales, codebooks, then the element data)

Every body field is aligned to its own size relative to the payload start, so element data can be
viewed in place (`torch.frombuffer`) instead of being copied out first.

A `Codec` turns a tensor into such a payload (`encode`, `encode_into`) and back (`decode`,
`decode_add`); subclasses only describe their body. Malformed payloads raise `CompressionError`.
"""

from __future__ import annotations

import abc
import ctypes
import enum
import math
import struct
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch

from swarm.compression._workspace import workspace
from swarm.core.errors import SwarmError

__all__ = [
    "HEADER_SIZE",
    "SUPPORTED_DTYPES",
    "Codec",
    "CompressionError",
    "CompressionType",
    "PayloadHeader",
    "read_header",
]

Buffer = bytes | bytearray | memoryview

HEADER_SIZE = 16
FORMAT_VERSION = 1
_HEADER = struct.Struct("<BBB5xQ")

_DTYPE_TO_CODE: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
}
_CODE_TO_DTYPE = {code: dtype for dtype, code in _DTYPE_TO_CODE.items()}
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_DTYPE_TO_CODE)

# torch warns (once per process) when a tensor views a read-only buffer such as `bytes`. Decoding
# only ever reads such views, so consume that one-time warning here instead of in a caller's code.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


class CompressionError(SwarmError, ValueError):
    """A tensor cannot be encoded as asked, or a payload is malformed."""


class CompressionType(enum.IntEnum):
    """How a tensor chunk is encoded; the first byte of every payload."""

    NONE = 0
    """The tensor's own dtype, bit for bit."""
    FLOAT16 = 1
    """IEEE half precision; refuses finite values beyond the float16 range."""
    SCALED_FLOAT16 = 2
    """Half precision after scaling by a power of two, so any finite range fits."""
    UNIFORM_8BIT = 3
    """256 evenly spaced levels between the chunk's minimum and maximum."""
    QUANTILE_8BIT = 4
    """Blockwise 8-bit codes into a codebook of 256 equal-population bucket means per block."""
    UNIFORM_4BIT = 5
    """16 evenly spaced levels between each 256-element block's minimum and maximum."""


@dataclass(frozen=True)
class PayloadHeader:
    """The common header of a payload.

    Attributes:
        kind: how the body is encoded.
        dtype: dtype of the tensor that was encoded (what `decode` allocates when given no `out`).
        numel: number of elements the payload holds.
    """

    kind: CompressionType
    dtype: torch.dtype
    numel: int


def _byte_view(payload: Buffer) -> memoryview:
    try:
        view = memoryview(payload)
    except TypeError:
        raise CompressionError(
            f"a payload must be bytes, bytearray or memoryview, not {type(payload).__name__}"
        ) from None
    if not view.c_contiguous:
        raise CompressionError("a payload must be a contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def read_header(payload: Buffer) -> PayloadHeader:
    """Parses and checks the common header of a payload.

    Args:
        payload: a whole payload (only its first 16 bytes are read).

    Returns:
        The header's fields.

    Raises:
        CompressionError: the payload is shorter than a header, or names an unknown compression
            type, format version or dtype.
    """
    view = _byte_view(payload)
    if len(view) < HEADER_SIZE:
        raise CompressionError(f"payload of {len(view)} bytes is shorter than the {HEADER_SIZE}-byte header")
    kind, version, dtype_code, numel = _HEADER.unpack_from(view)
    if version != FORMAT_VERSION:
        raise CompressionError(f"unsupported payload format version {version} (expected {FORMAT_VERSION})")
    try:
        kind = CompressionType(kind)
    except ValueError:
        raise CompressionError(f"unknown compression type {kind} in payload header") from None
    dtype = _CODE_TO_DTYPE.get(dtype_code)
    if dtype is None:
        raise CompressionError(f"unknown dtype code {dtype_code} in payload header")
    return PayloadHeader(kind=kind, dtype=dtype, numel=numel)


def _check_numel(numel: int) -> None:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _DTYPE_TO_CODE:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"compression supports only {supported}; got {dtype}")


def _flat_input(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    _check_dtype(tensor.dtype)
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.reshape(-1)


def value_range(flat: torch.Tensor) -> tuple[float, float]:
    """Returns (min, max) of a tensor as Python floats: NaN if it holds a NaN, (0, 0) if empty."""
    if flat.numel() == 0:
        return 0.0, 0.0
    low, high = torch.aminmax(flat)
    return low.item(), high.item()


def _write(dst: torch.Tensor, offset: int, data: bytes) -> None:
    """Copies `data` into the uint8 tensor `dst` at byte `offset`."""
    dst[offset : offset + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


class Codec(abc.ABC):
    """Encodes one chunk of a flat float tensor into a self-contained payload, and back.

    Codecs are stateless apart from per-thread scratch buffers, so one instance may be shared by
    every thread. Inputs of any shape are flattened; dtypes float32, float16, bfloat16 and float64
    are supported, and `decode` writes into an `out` of any of those dtypes.
    """

    kind: ClassVar[CompressionType]

    # --- what a subclass describes -------------------------------------------------------------

    @abc.abstractmethod
    def _body_size(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes after the header for `numel` elements of `dtype`."""

    @abc.abstractmethod
    def _encode_body(self, flat: torch.Tensor, body: torch.Tensor) -> None:
        """Writes the body for the 1-D CPU tensor `flat` (possibly empty) into the uint8 `body`."""

    @abc.abstractmethod
    def _decode_body(
        self, payload: memoryview, header: PayloadHeader, out: torch.Tensor, weight: float | None
    ) -> None:
        """Decodes a checked, non-empty payload into the contiguous 1-D CPU tensor `out`.

        Overwrites `out` when `weight` is None, else adds `weight * decoded` to it. Element data
        starts at byte `HEADER_SIZE` of `payload`.
        """

    # --- sizes ---------------------------------------------------------------------------------

    def encoded_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Returns exactly `len(self.encode(x))` for a tensor `x` of `numel` elements of `dtype`.

        Args:
            numel: number of elements.
            dtype: dtype of the tensor to encode (only NONE's size depends on it).
        """
        _check_numel(numel)
        _check_dtype(dtype)
        return HEADER_SIZE + self._body_size(numel, dtype)

    def chunk_numel(self, chunk_bytes: int = 1 << 20, dtype: torch.dtype = torch.float32) -> int:
        """Returns how many elements to put in one chunk so that its payload is about `chunk_bytes`.

        The result is the largest count whose payload fits in `chunk_bytes`, and at least 1.

        Args:
            chunk_bytes: target payload size in bytes.
            dtype: dtype of the tensor to encode (only NONE's size depends on it).
        """
        _check_numel(chunk_bytes)
        _check_dtype(dtype)
        # encoded_size is non-decreasing in numel: binary search the largest count that fits.
        low, high = 1, max(1, 8 * chunk_bytes)  # no codec spends less than a bit per element
        while low < high:
            mid = (low + high + 1) // 2
            if self.encoded_size(mid, dtype) <= chunk_bytes:
                low = mid
            else:
                high = mid - 1
        return low

    # --- encoding ------------------------------------------------------------------------------

    def encode(self, tensor: torch.Tensor) -> bytes:
        """Encodes a tensor (normally one chunk of a flat tensor) into a self-contained payload.

        Args:
            tensor: a float32, float16, bfloat16 or float64 tensor of any shape; it is flattened.

        Returns:
            The payload, `self.encoded_size(tensor.numel(), tensor.dtype)` bytes long.

        Raises:
            TypeError: the tensor's dtype is not supported.
            CompressionError: this codec cannot represent the values (see each codec).
        """
        flat = _flat_input(tensor)
        size = self.encoded_size(flat.numel(), flat.dtype)
        dst = workspace.get("payload", torch.uint8, size)
        self._encode_into(flat, dst)
        # One copy, from the warm scratch buffer into the new bytes object that gRPC will send.
        return ctypes.string_at(dst.data_ptr(), size)

    def encode_views(self, tensor: torch.Tensor) -> tuple[Buffer, ...]:
        """The payload `encode` would return, as buffers to send one after the other.

        A codec that stores the tensor's own bytes (NONE) returns its header and a view of the
        tensor's memory, so a transport that writes buffers (`swarm.net.bulk`) sends them without
        copying; the tensor must then stay unchanged until they are sent. Others return
        `(encode(tensor),)`.
        """
        return (self.encode(tensor),)

    def encode_into(self, tensor: torch.Tensor, buffer: bytearray | memoryview) -> int:
        """Encodes like `encode`, but into the start of a caller's writable buffer.

        Args:
            tensor: as for `encode`.
            buffer: writable, contiguous, at least `encoded_size(...)` bytes.

        Returns:
            The number of bytes written.

        Raises:
            TypeError: the tensor's dtype is not supported.
            ValueError: the buffer is read-only, not contiguous, or too small.
            CompressionError: this codec cannot represent the values.
        """
        flat = _flat_input(tensor)
        size = self.encoded_size(flat.numel(), flat.dtype)
        view = memoryview(buffer)
        if view.readonly or not view.c_contiguous:
            raise ValueError("encode_into needs a writable, contiguous buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if len(view) < size:
            raise ValueError(f"buffer of {len(view)} bytes cannot hold a {size}-byte payload")
        self._encode_into(flat, torch.frombuffer(view, dtype=torch.uint8, count=size))
        return size

    def _encode_into(self, flat: torch.Tensor, dst: torch.Tensor) -> None:
        numel = flat.numel()
        _write(dst, 0, _HEADER.pack(int(self.kind), FORMAT_VERSION, _DTYPE_TO_CODE[flat.dtype], numel))
        self._encode_body(flat, dst[HEADER_SIZE:])

    # --- decoding ------------------------------------------------------------------------------

    def decode(self, payload: Buffer, out: torch.Tensor) -> None:
        """Decodes a payload into a preallocated tensor, overwriting it.

        Args:
            payload: bytes made by this codec's `encode`.
            out: a float tensor with exactly the payload's number of elements (any shape, any
                supported dtype, any device; contiguous CPU tensors are written in place without a
                full-size temporary).

        Raises:
            CompressionError: the payload is malformed, of another compression type, or holds a
                different number of elements than `out`.
            TypeError: `out` is not a floating-point tensor.
        """
        self._decode(payload, out, None)

    def decode_add(self, payload: Buffer, out: torch.Tensor, weight: float = 1.0) -> None:
        """Adds `weight * decoded` into `out`: what a reducer does with each chunk as it arrives.

        Args:
            payload: bytes made by this codec's `encode`.
            out: the accumulator, as for `decode`.
            weight: finite multiplier for the decoded values.

        Raises:
            CompressionError: as for `decode`.
            TypeError: `out` is not a floating-point tensor.
            ValueError: `weight` is not a finite number.
        """
        weight = float(weight)
        if not math.isfinite(weight):
            raise ValueError(f"weight must be finite, got {weight}")
        self._decode(payload, out, weight)

    def check_payload(self, payload: Buffer) -> PayloadHeader:
        """Checks a payload's header and length against this codec.

        Returns:
            The payload's header.

        Raises:
            CompressionError: the payload is malformed or of another compression type.
        """
        header = read_header(payload)
        if header.kind != self.kind:
            raise CompressionError(f"{self.kind.name} codec cannot decode a {header.kind.name} payload")
        view = _byte_view(payload)
        expected = self._payload_size(view, header)
        actual = len(view)
        if actual != expected:
            raise CompressionError(
                f"{header.kind.name} payload of {header.numel} elements must be {expected} bytes, got {actual}"
            )
        return header

    def _payload_size(self, payload: memoryview, header: PayloadHeader) -> int:
        """The exact length a payload with this header must have (a codec whose layout depends on
        a parameter recorded in the body reads it from `payload`)."""
        return self.encoded_size(header.numel, header.dtype)

    def _decode(self, payload: Buffer, out: torch.Tensor, weight: float | None) -> None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if not out.is_floating_point():
            raise TypeError(f"out must be a floating-point tensor, got {out.dtype}")
        header = self.check_payload(payload)
        if header.numel != out.numel():
            raise CompressionError(f"payload holds {header.numel} elements but out has {out.numel()}")
        if header.numel == 0:
            return
        view = _byte_view(payload)
        if out.device.type == "cpu" and out.is_contiguous():
            self._decode_body(view, header, out.view(-1), weight)
            return
        # A strided or non-CPU accumulator: decode on the CPU first, then move the values over.
        staged = torch.empty(header.numel, dtype=out.dtype)
        self._decode_body(view, header, staged, None)
        staged = staged.view(out.shape).to(out.device)
        if weight is None:
            out.copy_(staged)
        else:
            out.add_(staged, alpha=weight)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
