"""Framing of the bulk side channel (`swarm.net.bulk`): one TCP connection carrying one stream at a
time (streams follow each other on a kept-alive connection).

A frame is one kind byte, a 4-byte little-endian length and the payload. DATA carries one
message; END closes the sender's side (as a gRPC half-close, or the end of a successful response
stream); ERROR ends the response stream with a status name and a message.

`FrameConnection` is the asyncio protocol of either end: it receives each frame straight into one
buffer (no stream-buffer copies), or into buffers a `Sink` chooses (the message then arrives as a
`Sunk`), and applies flow control both ways.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
from collections.abc import Callable
from typing import Any, Protocol

logger = logging.getLogger(__name__)

Frame = bytes | bytearray | memoryview
Frames = Frame | tuple[Frame, ...] | list[Frame]
"""One message as a writer hands it in: a buffer, or buffers sent back to back (not copied)."""


class FrameTransport(Protocol):
    """What a `FrameConnection` writes through and pauses: the socket's asyncio (or uvloop)
    transport, or a `RecordLayer`."""

    def write(self, data: Any) -> None: ...  # a buffer: bytes, memoryview, a numpy array
    def is_closing(self) -> bool: ...
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...
    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None: ...
    def get_extra_info(self, name: str, default: Any = None) -> Any: ...  # asyncio's signature


class RecordLayer(FrameTransport, Protocol):
    """A transport that seals what it carries (`swarm.net.sealed.SealedProtocol`): received records
    are opened on a worker, into the connection's buffers."""

    def trim(self) -> None:
        """Frees the spare record buffers (between streams)."""
        ...

    def settle(self) -> None:
        """Returns once no record is being opened into the connection's buffers."""
        ...

    @property
    def pending(self) -> bool:
        """Whether bytes were received that the connection has not been handed yet."""
        ...

DATA, END, ERROR = 0, 1, 2
_HEADER = struct.Struct("<BI")
_READ_LIMIT = 1 << 21        # received frames waiting for their reader before reading pauses
_WRITE_HIGH_WATER = 1 << 20  # drain() waits above this many unsent bytes
_SMALL = 1 << 12             # smaller payloads are handed out as bytes (headers, control messages)


class BulkProtocolError(ConnectionError):
    """The other side broke the framing, closed early, or sent an oversized frame."""


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
    more than its high-water mark. With `first_frame_limit` (the callee's end), the first frame and
    every frame right after a received END (a kept-alive connection's next token) may be at most
    that large.
    """

    def __init__(self, max_frame_bytes: int, first_frame_limit: int | None = None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._first_frame_limit = first_frame_limit
        self._limit = first_frame_limit or max_frame_bytes  # strangers get a small first frame
        self.after_end_limit = first_frame_limit
        self._after_end = False  # the next frame follows a received END
        """With `first_frame_limit`: how large the frame right after a received END may be (the
        listener raises it for a reopen frame once the connection carried its caller's stream)."""
        self.transport: FrameTransport | None = None
        self.records: RecordLayer | None = None  # the sealed record layer this connection runs over, if any
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
        self.read_data_frames = 0  # DATA frames handed out by read_frame
        self.stream_base = 0  # DATA frames of the connection's earlier streams (a sink counts from there)
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
        self._attach(transport)

    def sealed_by(self, records: RecordLayer) -> None:
        """In place of `connection_made` on a sealed connection: `records` is the transport, ready
        once its keys are agreed."""
        self.records = records
        self._attach(records)

    def _attach(self, transport: FrameTransport) -> None:
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
            if self._after_end:  # read now: the listener may have raised it since the END came
                self._limit, self._after_end = self.after_end_limit or self.max_frame_bytes, False
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
                if kind == END and self.after_end_limit is not None:
                    # the caller's stream ended: what may follow is the token (or reopen frame) of
                    # its next stream
                    self._after_end = True
                self._push(kind, b"")
                return
            else:
                # uninitialized memory (a bytearray would be zero-filled first, then overwritten)
                self._payload = _uninitialized(length) if length >= _SMALL else bytearray(length)
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

        `index` counts the connection's DATA frames from `stream_base + offset` (the frames of
        this stream, on a connection that carried others before); the sink returns buffers whose
        lengths add up to `length` (the payload is received into them, in order, and `read_frame`
        hands out a `Sunk`), or None for an ordinary payload. Frames already received are not
        affected. `detach_sink` stops it, even in the middle of a frame.
        """
        self.sink, self._sink_offset = sink, self.stream_base + offset

    def trim(self) -> None:
        """Between streams: lets the transport (sealed records) free its spare buffers."""
        if self.records is not None:
            self.records.trim()

    @property
    def idle(self) -> bool:
        """Open, with nothing received and not yet read: where the next stream may start."""
        return (self._closed is None and not self._frames and self._targets is None and self._got == 0
                and self.transport is not None and not self.transport.is_closing()
                and not (self.records is not None and self.records.pending))  # sealed records not yet handed on

    def detach_sink(self) -> None:
        """No frame is received into the sink's buffers from now on (the rest of a frame it was
        receiving is discarded, and that frame's `Sunk` says `dropped`)."""
        self.sink = None
        if self.records is not None:
            self.records.settle()  # a sealed record being opened into the sink's buffers on a worker lands first
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
        if kind == DATA:
            self.read_data_frames += 1
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


def _uninitialized(length: int) -> Any:
    """A writable buffer of `length` bytes that is not zero-filled first (numpy is imported on the
    first large frame, so a peer that never receives one, e.g. a DHT-only daemon, does not pay it).
    Without numpy (an infrastructure install: numpy comes with the torch extra) a bytearray, zero-filled."""
    try:
        import numpy
    except ImportError:
        return bytearray(length)
    return numpy.empty(length, dtype=numpy.uint8)


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)
