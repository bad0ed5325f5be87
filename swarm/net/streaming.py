"""Tensors over gRPC streams: a small header message, then raw-bytes chunks of about 1 MiB.

Sending costs one copy per chunk (grpc only accepts `bytes`); receiving copies each chunk
straight into a buffer allocated once from the header, after the header's sizes were checked
against the receiver's limit, so a lying peer cannot make it allocate without bound.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import torch

from swarm.core.errors import InvalidRequest, ResourceExhausted
from swarm.core.malloc import tune_malloc
from swarm.core.serialization import pack, unpack
from swarm.proto import tensor_pb2

CHUNK_BYTES = 1 << 20
DEFAULT_MAX_BYTES = 1 << 30

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidRequest(f"unsupported tensor dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def _as_bytes_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def tensors_to_messages(
    tensors: Sequence[torch.Tensor], metadata: object = None, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes]:
    """Yields the header, then the tensors' bytes back to back in chunks of `chunk_bytes`."""
    tune_malloc()
    views = [_as_bytes_view(t) for t in tensors]
    header = tensor_pb2.TensorBundleHeader(
        tensors=[
            tensor_pb2.TensorMeta(dtype=dtype_name(t.dtype), shape=list(t.shape), nbytes=len(v))
            for t, v in zip(tensors, views)
        ],
        metadata=pack(metadata) if metadata is not None else b"",
    )
    yield header.SerializeToString()
    pending = bytearray()
    for view in views:
        offset = 0
        if pending:
            take = min(chunk_bytes - len(pending), len(view))
            pending += view[:take]
            offset = take
            if len(pending) == chunk_bytes:
                yield bytes(pending)
                pending.clear()
        while len(view) - offset >= chunk_bytes:
            yield view[offset:offset + chunk_bytes].tobytes()
            offset += chunk_bytes
        if offset < len(view):
            pending += view[offset:]
    if pending:
        yield bytes(pending)


class TensorReceiver:
    """Reassembles tensors from a header and chunks, into buffers allocated once."""

    def __init__(self, header_bytes: bytes | memoryview, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        tune_malloc()
        try:
            header = tensor_pb2.TensorBundleHeader.FromString(header_bytes)
        except Exception as e:  # noqa: BLE001
            raise InvalidRequest(f"malformed tensor stream header: {e}") from None
        self.metadata = unpack(header.metadata) if header.metadata else None
        self.tensors: list[torch.Tensor] = []
        self._views: list[memoryview] = []
        total = 0
        for meta in header.tensors:
            dtype = parse_dtype(meta.dtype)
            if any(d < 0 for d in meta.shape):
                raise InvalidRequest(f"negative dimension in tensor shape {list(meta.shape)}")
            numel = 1
            for d in meta.shape:
                numel *= d
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if nbytes != meta.nbytes:
                raise InvalidRequest(f"tensor header says {meta.nbytes} bytes for {meta.dtype}{list(meta.shape)}")
            total += nbytes
            if total > max_bytes:
                raise ResourceExhausted(f"tensor stream of over {max_bytes} bytes refused")
            self.tensors.append(torch.empty(tuple(meta.shape), dtype=dtype))
        self._views = [_as_bytes_view(t) for t in self.tensors]
        self.total_bytes = total
        self._received = 0
        self._index = 0
        self._offset = 0

    @property
    def complete(self) -> bool:
        return self._received == self.total_bytes

    def feed(self, chunk: bytes | memoryview) -> None:
        """Copies one chunk into place; raises `InvalidRequest` if the stream overflows its header."""
        if self._received + len(chunk) > self.total_bytes:
            raise InvalidRequest("tensor stream carries more bytes than its header declared")
        src = memoryview(chunk)
        while src:
            while self._offset == len(self._views[self._index]):
                self._index += 1
                self._offset = 0
            dst = self._views[self._index]
            take = min(len(dst) - self._offset, len(src))
            dst[self._offset:self._offset + take] = src[:take]
            self._offset += take
            src = src[take:]
        self._received += len(chunk)

    def result(self) -> list[torch.Tensor]:
        if not self.complete:
            raise InvalidRequest(f"tensor stream ended after {self._received} of {self.total_bytes} bytes")
        return self.tensors


async def receive_tensors(
    messages: AsyncIterator[bytes | memoryview], max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[list[torch.Tensor], Any]:
    """Reads one bundle (header + chunks) from `messages`; returns (tensors, metadata).

    Reads exactly as many chunks as the header declares, so one stream may carry several bundles.
    """
    receiver: TensorReceiver | None = None
    async for message in messages:
        if receiver is None:
            receiver = TensorReceiver(message, max_bytes)
        else:
            receiver.feed(message)
        if receiver.complete:
            return receiver.result(), receiver.metadata
    if receiver is None:
        raise InvalidRequest("tensor stream ended before its header")
    return receiver.result(), receiver.metadata
