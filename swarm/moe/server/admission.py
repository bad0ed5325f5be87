"""What an expert server checks before it spends memory on a request.

A request's first message declares its tensors (dtype, shape, bytes). `check_declared` holds that
against the expert's schemas, so a wrong shape, a wrong dtype or an oversized batch is refused
before a single byte of the tensors is allocated or read. `Admission` bounds how many requests
are in flight and how many tensor bytes they hold together, so a burst of requests is queued
within those bounds or refused with RESOURCE_EXHAUSTED, never allowed to exhaust memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence

from swarm.core.errors import DeadlineExceeded, InvalidRequest, ResourceExhausted
from swarm.moe.schema import TensorSchema, dtype_name
from swarm.proto import tensor_pb2

__all__ = ["Admission", "check_declared", "check_declared_batch", "drain_request", "receive_header"]


def check_declared(
    header: tensor_pb2.TensorBundleHeader, schemas: Sequence[TensorSchema], max_batch_size: int, what: str
) -> int:
    """Checks the tensors a request header declares against the schemas.

    Args:
        header: the request's header.
        schemas: one schema per expected tensor.
        max_batch_size: the most rows accepted.
        what: names the request in messages, e.g. ``"forward of ffn.0.0"``.

    Returns:
        The number of tensor bytes the request will carry.

    Raises:
        InvalidRequest: wrong number of tensors, dtype, shape, or an empty or ragged batch.
        ResourceExhausted: more rows than `max_batch_size`.
    """
    metas = header.tensors
    if len(metas) != len(schemas):
        raise InvalidRequest(f"{what}: expected {len(schemas)} tensors, got {len(metas)}")
    return check_declared_batch(metas, schemas, max_batch_size, what)[1]


def check_declared_batch(
    metas: Sequence[tensor_pb2.TensorMeta], schemas: Sequence[TensorSchema], max_batch_size: int, what: str,
    rows: int | None = None,
) -> tuple[int, int]:
    """Checks declared tensors (as many as `schemas`) that form one batch against the schemas.

    Args:
        metas: the declared tensors, one per schema.
        schemas: one schema per tensor.
        max_batch_size: the most rows accepted.
        what: names the request in messages.
        rows: the batch size the tensors must have (None: any, as long as they agree).

    Returns:
        ``(rows, bytes)`` of the batch.

    Raises:
        InvalidRequest, ResourceExhausted: as `check_declared`.
    """
    batches: set[int] = set()
    total = 0
    for i, (meta, schema) in enumerate(zip(metas, schemas, strict=True)):
        shape = tuple(meta.shape)
        expected = ("batch", *schema.shape_without_batch)
        if meta.dtype != dtype_name(schema.dtype):
            raise InvalidRequest(f"{what}: tensor {i} has dtype {meta.dtype}, expected {dtype_name(schema.dtype)}")
        if len(shape) != len(expected) or shape[1:] != schema.shape_without_batch:
            raise InvalidRequest(
                f"{what}: tensor {i} has shape {shape}, expected ({', '.join(map(str, expected))})"
            )
        batches.add(shape[0])
        total += meta.nbytes
    if rows is not None:
        batches.add(rows)
    if len(batches) != 1:
        raise InvalidRequest(f"{what}: tensors disagree on the batch size: {sorted(batches)}")
    (batch,) = batches
    if batch < 1:
        raise InvalidRequest(f"{what}: the batch is empty")
    if batch > max_batch_size:
        raise ResourceExhausted(f"{what}: batch of {batch} rows exceeds the limit of {max_batch_size}; split it")
    return batch, total


async def drain_request(stream: AsyncIterator[bytes], limit: int, timeout: float | None = None) -> None:
    """Reads and drops up to `limit` bytes of what is left of a refused request stream, for at most
    `timeout` seconds.

    A call that ends while the caller is still writing reaches it as INTERNAL instead of the
    status that says why it was refused; a caller that writes nothing more must not hold the
    refusal up.
    """
    drained = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in stream:
                drained += len(chunk)
                if drained > limit:
                    return
    except Exception:  # noqa: BLE001 - the call may be over or stalled; the refusal is what matters
        return


async def receive_header(stream: AsyncIterator[bytes], timeout: float, what: str) -> bytes:
    """The first message of a request stream, which must arrive within `timeout` seconds.

    Raises:
        InvalidRequest: the stream ended before it.
        DeadlineExceeded: it did not arrive in time.
    """
    try:
        async with asyncio.timeout(timeout):
            header = await anext(stream, None)
    except TimeoutError:
        raise DeadlineExceeded(f"{what}: no request header within {timeout:g} s") from None
    if header is None:
        raise InvalidRequest(f"{what}: empty request stream")
    return header


class Admission:
    """Counts requests in flight and the tensor bytes they hold; refuses past the limits.

    Used from one event loop only (no locking).

    Args:
        max_requests: the most requests in flight at once.
        max_bytes: the most tensor bytes held by requests in flight at once.
        max_per_caller: the most requests in flight at once for one caller (None: `max_requests`).
        max_per_source: the most requests in flight at once from one source, the network a call
            came from (`swarm.net.server.source_of`), whatever identities it uses (None:
            `max_requests`). Calls with no source (loopback, by default) are not counted.
    """

    def __init__(self, max_requests: int, max_bytes: int, max_per_caller: int | None = None,
                 max_per_source: int | None = None) -> None:
        if max_requests < 1 or max_bytes < 1 or (max_per_caller is not None and max_per_caller < 1) \
                or (max_per_source is not None and max_per_source < 1):
            raise ValueError("admission limits must be positive")
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.max_per_caller = min(max_requests, max_per_caller or max_requests)
        self.max_per_source = min(max_requests, max_per_source or max_requests)
        self.by_caller: dict[str, int] = {}
        """Requests in flight per caller (callers with none are left out)."""
        self.by_source: dict[str, int] = {}
        """Requests in flight per source (sources with none, and calls with no source, are left out)."""
        self.requests = 0
        self.bytes = 0
        self.admitted = 0
        """Requests admitted so far."""
        self.refused = 0
        """Requests refused so far because a limit was reached."""
        self.too_slow = 0
        """Admitted requests that lost their slot because their tensors arrived below the minimum rate."""
        self._idle: asyncio.Event | None = None

    async def wait_idle(self) -> None:
        """Returns once no request is in flight."""
        while self.requests:
            if self._idle is None or self._idle.is_set():
                self._idle = asyncio.Event()
            await self._idle.wait()

    @contextlib.contextmanager
    def request(self, what: str, caller: str = "", source: str = "") -> Iterator[None]:
        """Holds one request slot (of the server's, `caller`'s and `source`'s) for the duration of the block."""
        if self.requests >= self.max_requests:
            self.refused += 1
            raise ResourceExhausted(
                f"{what}: the server has {self.requests} requests in flight, its limit; retry later"
            )
        held = self.by_caller.get(caller, 0)
        if held >= self.max_per_caller:
            self.refused += 1
            raise ResourceExhausted(
                f"{what}: this caller has {held} requests in flight, the server's limit per caller; retry later"
            )
        from_source = self.by_source.get(source, 0) if source else 0
        if source and from_source >= self.max_per_source:
            self.refused += 1
            raise ResourceExhausted(
                f"{what}: {from_source} requests from this caller's network ({source}) are in flight, "
                f"the server's limit per source address; retry later"
            )
        self.by_caller[caller] = held + 1
        if source:
            self.by_source[source] = from_source + 1
        self.requests += 1
        self.admitted += 1
        try:
            yield
        finally:
            self.requests -= 1
            _release(self.by_caller, caller)
            if source:
                _release(self.by_source, source)
            if not self.requests and self._idle is not None:
                self._idle.set()

    @contextlib.contextmanager
    def reserve(self, nbytes: int, what: str) -> Iterator[None]:
        """Holds `nbytes` of the byte budget for the duration of the block."""
        if nbytes > self.max_bytes - self.bytes:
            self.refused += 1
            raise ResourceExhausted(
                f"{what}: {nbytes} bytes would exceed the server's budget for requests in flight "
                f"({self.bytes} of {self.max_bytes} bytes held); retry later"
            )
        self.bytes += nbytes
        try:
            yield
        finally:
            self.bytes -= nbytes


def _release(counts: dict[str, int], key: str) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
