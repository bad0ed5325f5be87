"""The bulk side channel: a registered stream's bytes over a plain TCP connection instead of gRPC.

TRANSPORT.md measured gRPC's own framing at about half of an all-reduce's time, and raw sockets
near the loopback ceiling. So a stream registered with ``bulk=True`` can also be reached this way:

1. the caller asks for a token with the authenticated unary call ``/swarm.Peer/OpenBulk``
   (method, timeout) and gets the callee's bulk port and 16 random bytes, valid once and for a
   few seconds, bound to the caller's PeerID and the method;
2. it dials that port on the host it already reached the callee at and sends the token first;
3. both sides then exchange frames: one kind byte, a 4-byte little-endian length, the payload.
   DATA carries one message; END closes the sender's side (as a gRPC half-close, or the end of
   a successful response stream); ERROR ends the response stream with a status name and message,
   which the caller raises as the same typed error a gRPC status would give.

The handler is the one the gRPC stream runs (same `CallContext`: caller PeerID, deadline), so the
two paths cannot drift apart. The callee's identity is proven by the gRPC handshake of the channel
the token came over; the caller's by the ticket of that call. A caller that cannot reach the bulk
port (a firewall, a container publishing only the gRPC port) falls back to the gRPC stream and
remembers to skip the side channel for that peer.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy

from swarm.core.errors import (
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    PeerUnreachable,
    ResourceExhausted,
    RPCError,
)
from swarm.net.errors import from_status, to_status

logger = logging.getLogger(__name__)

OPEN_BULK = "/swarm.Peer/OpenBulk"
TOKEN_BYTES = 16
DATA, END, ERROR = 0, 1, 2
_HEADER = struct.Struct("<BI")
_READ_LIMIT = 1 << 21        # received frames waiting for their reader before reading pauses
_WRITE_HIGH_WATER = 1 << 20  # drain() waits above this many unsent bytes
_SMALL = 1 << 12             # smaller payloads are handed out as bytes (headers, control messages)


class BulkProtocolError(ConnectionError):
    """The other side broke the framing, closed early, or sent an oversized frame."""


@dataclass
class _Ticket:
    caller: str
    method: str
    timeout: float
    expires: float  # time.monotonic()


class Sunk:
    """A DATA frame received straight into a consumer's buffers (`FrameConnection.set_sink`).

    Attributes:
        views: the buffers, filled in order ([] when `dropped`).
        dropped: the sink was detached mid-frame: the rest of the payload was discarded.
    """

    __slots__ = ("dropped", "length", "views")

    def __init__(self, views: list[memoryview], length: int) -> None:
        self.views, self.length, self.dropped = views, length, False

    def __len__(self) -> int:
        return self.length


class Sink:
    """Where the payloads of a stream's later messages go, chosen per message by `choose(index, length)`
    (buffers whose lengths add up to `length`, or None for an ordinary message); such a message
    arrives as a `Sunk`. Pass it to `PeerChannel.stream(sink=...)` or `CallContext.receive_into`;
    it only acts on the bulk side channel (gRPC messages always arrive as bytes).
    """

    def __init__(self, choose: Callable[[int, int], Any]) -> None:
        self.choose = choose
        self._conn: FrameConnection | None = None

    def attach(self, conn: FrameConnection, offset: int = 0) -> None:
        self._conn = conn
        conn.set_sink(self.choose, offset)

    def detach(self) -> None:
        """Nothing more is written into the chosen buffers, even the rest of a message in progress."""
        if self._conn is not None:
            self._conn.detach_sink()
            self._conn = None


class FrameConnection(asyncio.BufferedProtocol):
    """One bulk connection: frames read straight into one buffer each (no stream-buffer copies),
    with flow control both ways.

    `read_frame` returns (kind, payload); a payload of at least `_SMALL` bytes is a memoryview of
    the buffer the frame was received into, smaller ones are `bytes`. Reading pauses while more than
    `_READ_LIMIT` bytes of frames wait for the reader; `drain` waits while the transport holds
    more than its high-water mark.
    """

    def __init__(self, max_frame_bytes: int, first_frame_limit: int | None = None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._limit = first_frame_limit or max_frame_bytes  # strangers get a small first frame
        self.transport: Any = None
        self._header = bytearray(_HEADER.size)
        self._header_view = memoryview(self._header)
        self._got = 0
        self._kind = 0
        self._payload: Any = None  # an ordinary frame's buffer: a numpy uint8 array or a bytearray
        self._targets: list[memoryview] | None = None  # where the current frame's payload goes
        self._target = 0
        self._sunk: Sunk | None = None
        self.sink: Callable[[int, int], Any] | None = None
        self._sink_offset = 0
        self._ordinal = 0  # DATA frames seen
        self._frames: collections.deque[tuple[int, bytes | memoryview]] = collections.deque()
        self._queued = 0
        self._paused = False
        self._closed: BaseException | None = None
        self._readable: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._write_paused = False
        self.connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- asyncio callbacks -------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:  # uvloop's transports are not asyncio.Transport
        self.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        if not self.connected.done():
            self.connected.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._targets is not None:
            return self._targets[self._target][self._got:]
        return self._header_view[self._got:]

    def buffer_updated(self, nbytes: int) -> None:
        self._got += nbytes
        if self._targets is None:
            if self._got < _HEADER.size:
                return
            kind, length = _HEADER.unpack(self._header)
            if kind not in (DATA, END, ERROR) or length > self._limit:
                why = f"unknown frame kind {kind}" if kind not in (DATA, END, ERROR) else (
                    f"frame of {length} bytes exceeds the {self._limit}-byte limit")
                self._fail(BulkProtocolError(why))
                if self.transport is not None:
                    self.transport.abort()
                return
            self._limit = self.max_frame_bytes
            self._kind, self._got = kind, 0
            views = self._sink_views(length) if kind == DATA else None
            if kind == DATA:
                self._ordinal += 1
            if views is not None:
                self._sunk = Sunk(views, length)
                self._targets = [v for v in views if len(v)]
            elif length == 0:
                self._push(kind, b"")
                return
            else:
                # uninitialized memory (a bytearray would be zero-filled first, then overwritten)
                self._payload = numpy.empty(length, dtype=numpy.uint8) if length >= _SMALL else bytearray(length)
                self._targets = [memoryview(self._payload)]
            self._target = 0
            if not self._targets:  # a sink that took an empty frame
                self._complete()
            return
        if self._got < len(self._targets[self._target]):
            return
        self._target, self._got = self._target + 1, 0
        if self._target == len(self._targets):
            self._complete()

    def _sink_views(self, length: int) -> list[memoryview] | None:
        if self.sink is None:
            return None
        try:
            views = self.sink(self._ordinal - self._sink_offset, length)
            if views is None:
                return None
            views = [memoryview(v).cast("B") for v in views]
        except Exception:  # a faulty sink costs a copy, never the connection
            logger.debug("bulk sink failed", exc_info=True)
            return None
        if sum(len(v) for v in views) != length or any(v.readonly for v in views):
            return None
        return views

    def _complete(self) -> None:
        if self._sunk is not None:
            payload: Any = self._sunk
        elif self._payload is not None and len(self._payload) >= _SMALL:
            payload = self._targets[0] if self._targets else b""
        else:
            payload = bytes(self._payload) if self._payload is not None else b""
        self._payload = self._targets = self._sunk = None
        self._got = 0
        self._push(self._kind, payload)

    def set_sink(self, sink: Callable[[int, int], Any] | None, offset: int = 0) -> None:
        """Lets `sink(index, length)` choose where each later DATA frame's payload is received.

        `index` counts the connection's DATA frames from `offset`; the sink returns buffers whose
        lengths add up to `length` (the payload is received into them, in order, and `read_frame`
        hands out a `Sunk`), or None for an ordinary payload. Frames already received are not
        affected. `detach_sink` stops it, even in the middle of a frame.
        """
        self.sink, self._sink_offset = sink, offset

    def detach_sink(self) -> None:
        """No frame is received into the sink's buffers from now on (the rest of a frame it was
        receiving is discarded, and that frame's `Sunk` says `dropped`)."""
        self.sink = None
        if self._sunk is not None and self._targets is not None:
            rest = len(self._targets[self._target]) - self._got + sum(
                len(v) for v in self._targets[self._target + 1:])
            self._sunk.dropped = True
            self._sunk.views = []
            self._targets, self._target, self._got = [memoryview(bytearray(rest))], 0, 0

    def _push(self, kind: int, payload: bytes | memoryview) -> None:
        self._frames.append((kind, payload))
        self._queued += len(payload)
        if self._queued > _READ_LIMIT and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        _wake(self._readable)

    def eof_received(self) -> bool:
        self._fail(BulkProtocolError("the connection closed mid-stream"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc if isinstance(exc, Exception) else BulkProtocolError("the connection closed"))
        _wake(self._writable)
        if not self.connected.done():
            self.connected.set_exception(self._closed or BulkProtocolError("closed"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        _wake(self._writable)

    def _fail(self, error: BaseException) -> None:
        if self._closed is None:
            self._closed = error
        _wake(self._readable)

    # -- the stream's side -------------------------------------------------------------------

    async def read_frame(self) -> tuple[int, bytes | memoryview]:
        """The next frame; raises `BulkProtocolError` once the connection broke or closed."""
        while not self._frames:
            if self._closed is not None:
                raise BulkProtocolError(str(self._closed) or type(self._closed).__name__)
            self._readable = asyncio.get_running_loop().create_future()
            try:
                await self._readable
            finally:
                self._readable = None
        kind, payload = self._frames.popleft()
        self._queued -= len(payload)
        if self._paused and self._queued <= _READ_LIMIT // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return kind, payload

    def write_frame(self, kind: int, payload: Any = b"") -> None:
        """Queues one frame; `payload` is a buffer or a tuple of buffers sent back to back (not copied:
        they must stay unchanged until sent)."""
        if self._closed is not None or self.transport is None or self.transport.is_closing():
            raise BulkProtocolError("the connection is closed")
        parts = payload if isinstance(payload, tuple | list) else (payload,)
        self.transport.write(_HEADER.pack(kind, sum(len(p) for p in parts)))
        for part in parts:
            if len(part):
                self.transport.write(part)

    async def drain(self) -> None:
        while self._write_paused:
            if self._closed is not None:
                raise BulkProtocolError("the connection is closed")
            self._writable = asyncio.get_running_loop().create_future()
            try:
                await self._writable
            finally:
                self._writable = None
        if self._closed is not None and self.transport is not None and self.transport.is_closing():
            raise BulkProtocolError("the connection is closed")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


def encode_error(error: BaseException) -> bytes:
    code = to_status(error) or grpc.StatusCode.INTERNAL
    message = str(error) if to_status(error) is not None else f"internal error: {type(error).__name__}: {error}"
    return f"{code.name}\n{message}".encode()


def decode_error(payload: bytes, peer_id: str, method: str) -> RPCError:
    name, _, message = payload.decode(errors="replace").partition("\n")
    code = getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return from_status(code, message, peer_id, method)


class BulkListener:
    """The callee's side: issues tokens, accepts connections, runs the registered stream handlers.

    Args:
        handlers: method path -> `handler(requests, ctx)` (the server's bulk-enabled streams).
        make_context: builds the handler's `CallContext` from (caller PeerID, deadline, connection).
        max_frame_bytes: largest frame accepted.
        token_ttl: seconds a token stays valid before its connection arrives.
        max_tickets: tokens outstanding at once (more are refused: RESOURCE_EXHAUSTED).
    """

    def __init__(
        self, handlers: dict[str, Any], make_context: Callable[[str, float, FrameConnection], Any],
        max_frame_bytes: int,
        token_ttl: float = 10.0, max_tickets: int = 4096,
    ) -> None:
        self.handlers = handlers
        self.make_context = make_context
        self.max_frame_bytes = max_frame_bytes
        self.token_ttl = token_ttl
        self.max_tickets = max_tickets
        self.port: int | None = None
        self._tickets: dict[bytes, _Ticket] = {}
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, host, port, reuse_port=False)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def _protocol(self) -> FrameConnection:
        conn = FrameConnection(self.max_frame_bytes, first_frame_limit=TOKEN_BYTES)
        task = asyncio.ensure_future(self._accept(conn))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)
        return conn

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        self._tickets.clear()

    # -- tokens (the OpenBulk call) ----------------------------------------------------------

    def issue(self, caller: str, method: str, timeout: float) -> bytes:
        """A one-time token for `caller` to open `method`; raises when it is not a bulk stream."""
        if self.port is None:
            raise NotFound("this peer has no bulk port")
        if method not in self.handlers:
            raise NotFound(f"{method} is not served over the bulk channel")
        if not (0 < timeout < 1e6):
            raise InvalidRequest(f"bad bulk stream timeout {timeout!r}")
        now = time.monotonic()
        if len(self._tickets) >= self.max_tickets:
            self._tickets = {t: k for t, k in self._tickets.items() if k.expires > now}
            if len(self._tickets) >= self.max_tickets:
                raise ResourceExhausted("too many bulk streams being opened")
        token = os.urandom(TOKEN_BYTES)
        self._tickets[token] = _Ticket(caller, method, timeout, now + self.token_ttl)
        return token

    # -- connections -------------------------------------------------------------------------

    async def _accept(self, conn: FrameConnection) -> None:
        try:
            await conn.connected
            await self._serve(conn)
        except (ConnectionError, TimeoutError) as e:
            logger.debug("bulk connection ended: %s", e)
        finally:
            conn.close()

    async def _serve(self, conn: FrameConnection) -> None:
        # the first frame is the token (a stranger gets nothing bigger than that read)
        kind, token = await asyncio.wait_for(conn.read_frame(), self.token_ttl)
        ticket = self._tickets.pop(bytes(token), None) if kind == DATA else None
        if ticket is None or ticket.expires < time.monotonic():
            return  # unknown, used or expired: nothing to say to a stranger
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ticket.timeout
        ctx = self.make_context(ticket.caller, deadline, conn)
        me = asyncio.current_task()
        assert me is not None
        expire = loop.call_at(deadline, me.cancel)
        responses = self.handlers[ticket.method](_requests(conn), ctx)
        try:
            async for response in responses:
                conn.write_frame(DATA, response)
                await conn.drain()
            conn.write_frame(END)
        except asyncio.CancelledError:
            if loop.time() < deadline:
                raise  # the listener stops
            me.uncancel()
            conn.write_frame(ERROR, encode_error(DeadlineExceeded("deadline exceeded")))
        except Exception as e:
            if to_status(e) is None and not isinstance(e, ConnectionError):
                logger.exception("bulk handler %s failed", ticket.method)
            if not isinstance(e, ConnectionError):
                conn.write_frame(ERROR, encode_error(e))
        finally:
            expire.cancel()
            await responses.aclose()
        # Let the caller close first: closing with its data still unread would reset the
        # connection and could destroy our last frames on the way.
        try:
            await asyncio.wait_for(_discard_until_closed(conn), 2.0)
        except TimeoutError:
            pass


async def _requests(conn: FrameConnection) -> AsyncIterator[bytes | memoryview]:
    while True:
        kind, payload = await conn.read_frame()
        if kind == END:
            return
        if kind != DATA:
            raise BulkProtocolError("the caller sent an ERROR frame")
        yield payload


async def _discard_until_closed(conn: FrameConnection) -> None:
    try:
        while True:
            await conn.read_frame()
    except BulkProtocolError:
        pass


async def connect(host: str, port: int, token: bytes, timeout: float, max_frame_bytes: int,
                  peer_id: str) -> FrameConnection:
    """Dials the callee's bulk port and presents the token; `PeerUnreachable` if it cannot be reached
    within `timeout` (nothing was sent then: the caller may fall back to gRPC)."""
    loop = asyncio.get_running_loop()
    try:
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: FrameConnection(max_frame_bytes), host, port), timeout)
    except (OSError, TimeoutError) as e:
        raise PeerUnreachable(f"bulk port {host}:{port} unreachable ({type(e).__name__}: {e})",
                              peer_id=peer_id) from None
    conn.write_frame(DATA, token)
    return conn


async def exchange(
    conn: FrameConnection, requests: AsyncIterator[bytes] | Iterable[bytes], deadline: float, peer_id: str,
    method: str, on_sent: Callable[[int], None] | None = None, on_received: Callable[[int], None] | None = None,
) -> AsyncIterator[bytes | memoryview]:
    """The caller's side of one bulk stream on a connection from `connect`: sends `requests`, yields
    the responses. Raises `DeadlineExceeded` past `deadline` (loop time), `PeerUnreachable` when the
    connection breaks, and the callee's error as the typed error its status maps to."""
    loop = asyncio.get_running_loop()
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        conn.abort()  # wakes the reader and the sender with a connection error

    timer = loop.call_at(deadline, expire)
    sender = asyncio.ensure_future(_send(conn, requests, on_sent))
    try:
        while True:
            try:
                kind, payload = await conn.read_frame()
            except BulkProtocolError as e:
                if expired:
                    raise DeadlineExceeded(f"deadline exceeded ({method} on {peer_id})", peer_id=peer_id) from None
                if sender.done() and not sender.cancelled() and sender.exception() is not None:
                    raise sender.exception() from None  # the request iterator failed
                raise PeerUnreachable(f"bulk stream broke: {e} ({method} on {peer_id})", peer_id=peer_id) from None
            if kind == END:
                return
            if kind == ERROR:
                raise decode_error(payload, peer_id, method)
            if on_received is not None:
                on_received(len(payload))
            yield payload
    finally:
        timer.cancel()
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        conn.abort()


def _length(message: Any) -> int:
    return sum(len(part) for part in message) if isinstance(message, tuple | list) else len(message)


async def _send(conn: FrameConnection, requests: AsyncIterator[bytes] | Iterable[bytes],
                on_sent: Callable[[int], None] | None) -> None:
    try:
        if hasattr(requests, "__aiter__"):
            async for message in requests:  # type: ignore[union-attr]
                conn.write_frame(DATA, message)
                if on_sent is not None:
                    on_sent(_length(message))
                await conn.drain()
        else:
            for message in requests:  # type: ignore[union-attr]
                conn.write_frame(DATA, message)
                if on_sent is not None:
                    on_sent(_length(message))
                await conn.drain()
        conn.write_frame(END)
    except BulkProtocolError:
        pass  # the reader sees the broken connection and reports it
    except BaseException:
        conn.abort()  # the request iterator failed (or we were cancelled): end the stream
        raise
