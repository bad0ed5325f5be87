"""The bulk side channel: a registered stream's bytes over a plain TCP connection instead of gRPC.

gRPC's own framing costs about half of an all-reduce's time, and raw sockets run near the
loopback ceiling (BENCHMARKS.md, "Transport facts"). So a stream registered with ``bulk=True`` can also be reached this way:

1. the caller asks for a token with the authenticated unary call ``/swarm.Peer/OpenBulk``
   (method, timeout) and gets the callee's bulk port and 16 random bytes, valid once and for a
   few seconds, bound to the caller's PeerID and the method;
2. it dials that port on the host it already reached the callee at and sends the token first;
3. both sides then exchange frames (`swarm.net.frames`); an ERROR frame's status becomes the
   same typed error a gRPC status would give;
4. a connection whose stream ended cleanly both ways may carry the caller's next stream to the
   same callee: it starts with a new token, or, where the callee said so in the OpenBulk answer
   that opened the connection (`BulkOpenResponse.reopen`), with an in-band reopen frame naming the
   method and timeout, and no OpenBulk call at all (`reopen`). The connection's caller is the
   one its first token was issued to: its TLS session carries only that caller's frames.

The handler is the one the gRPC stream runs (same `CallContext`: caller PeerID, deadline), so the
two paths cannot drift apart. The connection starts with a TLS 1.3 handshake with the callee's gRPC
certificate, checked against the PeerID the caller dialed (`swarm.net.tls`), and then carries
AES-GCM records under keys agreed inside it (`swarm.net.sealed`), unless both peers run insecure:
so the token, and every tensor after it, reaches only the callee. The caller's identity is proven by the
ticket of the OpenBulk call, which travelled inside the gRPC channel's TLS. A caller that cannot reach the bulk
port (a firewall, a container publishing only the gRPC port) falls back to the gRPC stream and
remembers to skip the side channel for that peer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import ssl
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

import grpc

from swarm.core.errors import (
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    PeerUnreachable,
    ResourceExhausted,
    RPCError,
)
from swarm.net.errors import from_status, to_status
from swarm.net.frames import DATA, END, ERROR, BulkProtocolError, FrameConnection, Frames, Sink, Sunk
from swarm.net.sealed import SealedProtocol
from swarm.net.sockets import connected_socket, listening_socket
from swarm.net.tls import SERVER_NAME_BYTES, ServerContext, client_context

logger = logging.getLogger(__name__)

OPEN_BULK = "/swarm.Peer/OpenBulk"
TOKEN_BYTES = 16
# An in-band reopen frame: this tag, the stream's timeout (float64, big-endian), its method path
# (UTF-8). Never TOKEN_BYTES long (a method path is longer than 4 bytes), so never taken for a token.
REOPEN_TAG = b"SWR1"
REOPEN_LIMIT = 512  # bytes a frame right after a clean END may have on a connection with a known caller
# Bytes a bulk connection's kernel send queue may hold beyond what is in flight (TCP_NOTSENT_LOWAT;
# 0: the kernel's default, as much as the autotuned send buffer takes, 3-4 MB per connection on a
# 100 Mbit/s, 50 ms link). Kept small, a stream's writer waits on its own flow's progress, not on
# a queue of seconds, so a peer's streams can be kept level (`swarm.averaging.lockstep`), and what
# is left queued when a phase ends is small; 256 KiB still lasts tens of milliseconds at 100 Mbit/s.
NOTSENT_LOWAT = 256 << 10

__all__ = ["DATA", "END", "ERROR", "OPEN_BULK", "TOKEN_BYTES", "BulkListener", "BulkProtocolError",
           "FrameConnection", "Sink", "Sunk", "connect", "exchange", "reopen", "reuse"]


@dataclass
class _Ticket:
    caller: str
    method: str
    timeout: float
    expires: float  # time.monotonic()


def encode_error(error: BaseException) -> bytes:
    code = to_status(error) or grpc.StatusCode.INTERNAL
    message = str(error) if to_status(error) is not None else f"internal error: {type(error).__name__}: {error}"
    return f"{code.name}\n{message}".encode()


def decode_error(payload: bytes | memoryview, peer_id: str, method: str) -> RPCError:
    name, _, message = bytes(payload).decode(errors="replace").partition("\n")
    code = getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return from_status(code, message, peer_id, method)


C = TypeVar("C")  # the context a handler is given (the server's `CallContext`)
BulkHandler = Callable[[AsyncIterator[bytes], C], AsyncGenerator[object, None]]
"""`handler(requests, ctx)`: a bulk-enabled stream's handler; it yields the response messages."""


class BulkListener(Generic[C]):
    """The callee's side: issues tokens, accepts connections, runs the registered stream handlers.

    Args:
        handlers: method path -> `handler(requests, ctx)` (the server's bulk-enabled streams).
        make_context: builds the handler's `CallContext` from (caller PeerID, deadline, connection).
        max_frame_bytes: largest frame accepted.
        token_ttl: seconds a token stays valid before its connection arrives.
        idle_timeout: seconds a connection whose stream ended cleanly waits for the caller's next
            token before it is closed (callers keep theirs for less, `ChannelConfig.bulk_idle_timeout`).
        max_tickets: tokens outstanding at once (more are refused: RESOURCE_EXHAUSTED).
    """

    def __init__(
        self, handlers: dict[str, BulkHandler[C]], make_context: Callable[[str, float, FrameConnection], C],
        max_frame_bytes: int,
        token_ttl: float = 10.0, max_tickets: int = 4096, idle_timeout: float = 60.0,
    ) -> None:
        self.handlers = handlers
        self.make_context = make_context
        self.max_frame_bytes = max_frame_bytes
        self.token_ttl = token_ttl
        self.idle_timeout = idle_timeout
        self.max_tickets = max_tickets
        self.port: int | None = None
        self.reopen = True
        """Whether the OpenBulk answers say that this listener takes reopen frames (it always
        does; False answers as a peer of an earlier version would, whose callers then ask for a
        token for every stream)."""
        self._tickets: dict[bytes, _Ticket] = {}
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._ssl: ServerContext | Callable[[], ServerContext] | None = None

    async def start(self, host: str, port: int = 0,
                    ssl_context: ServerContext | Callable[[], ServerContext] | None = None) -> int:
        """Listens on `host:port`; with `ssl_context` (`swarm.net.tls.server_context`), every
        connection is a TLS handshake first, then sealed records (`swarm.net.sealed`).

        `ssl_context` may be a function that makes it: it runs when the first connection comes
        (a peer that never receives a bulk connection, a DHT-only daemon, never loads OpenSSL's
        key and certificate code for it: ~0.9 MB of its memory, BENCHMARKS.md)."""
        loop = asyncio.get_running_loop()
        self._ssl = ssl_context
        sock = listening_socket(host, port)
        self._server = await (loop.create_server(self._protocol, sock=sock) if sock is not None else
                              loop.create_server(self._protocol, host, port, reuse_port=False))
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def _protocol(self) -> asyncio.BufferedProtocol:
        conn = FrameConnection(self.max_frame_bytes, first_frame_limit=TOKEN_BYTES)
        protocol: FrameConnection | SealedProtocol = conn
        ready = conn.connected
        if self._ssl is not None:
            if not isinstance(self._ssl, ServerContext):
                self._ssl = self._ssl()
            protocol = SealedProtocol(conn, self._ssl, server_side=True, certificate=self._ssl.certificate_der)
            ready = protocol.ready
        task = asyncio.ensure_future(self._accept(conn, ready, protocol))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)
        return protocol

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

    async def _accept(self, conn: FrameConnection, ready: asyncio.Future[None], protocol: FrameConnection | SealedProtocol) -> None:
        try:
            # over TLS the frames start only once the handshake and the key agreement succeeded
            # (never, for a plaintext or unverifiable caller): wait a bounded time
            await asyncio.wait_for(asyncio.shield(ready), self.token_ttl)
            limit_unsent(conn.transport.get_extra_info("socket") if conn.transport is not None else None)
            wait = self.token_ttl
            caller = ""
            while True:
                clean, caller = await self._serve(conn, wait, caller)
                if not clean:
                    break
                # a clean end both ways: the caller may start its next stream here (a new token,
                # or a reopen frame)
                conn.trim()
                wait = self.idle_timeout
        except (OSError, TimeoutError) as e:  # ssl.SSLError is an OSError
            logger.debug("bulk connection ended: %s", e)
        finally:
            protocol.close()

    async def _serve(self, conn: FrameConnection, wait: float, caller: str) -> tuple[bool, str]:
        """One stream on a connection whose earlier streams' caller is `caller` ("" before the
        first); returns whether it ended cleanly both ways (the connection may carry another) and
        the connection's caller."""
        # the first frame is the token (a stranger gets nothing bigger than that read), or on a
        # connection that carried a stream of its caller, a reopen frame
        kind, first = await asyncio.wait_for(conn.read_frame(), wait)
        ticket = None
        if kind == DATA and len(first) == TOKEN_BYTES:
            ticket = self._tickets.pop(bytes(first), None)
        elif kind == DATA and caller:
            ticket = self._reopened(caller, bytes(first))
        if ticket is None or ticket.expires < time.monotonic() or (caller and ticket.caller != caller):
            return False, caller  # unknown, used, expired or another caller's: nothing to say to a stranger
        caller = ticket.caller
        # the connection is its caller's now: its next stream's first frame may be a reopen frame,
        # which may follow this stream's END before this stream's answer is done
        conn.after_end_limit = REOPEN_LIMIT
        conn.stream_base = conn.read_data_frames - 1  # the token is this stream's first message
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ticket.timeout
        ctx = self.make_context(ticket.caller, deadline, conn)
        me = asyncio.current_task()
        assert me is not None
        expire = loop.call_at(deadline, me.cancel)
        requests = _Requests(conn)
        # large messages arrive as memoryviews (or `Sunk`): handlers read them as they read bytes
        responses = self.handlers[ticket.method](cast("AsyncIterator[bytes]", requests), ctx)
        clean = False
        try:
            async for response in responses:
                conn.write_frame(DATA, response)
                await conn.drain()
            conn.write_frame(END)
            clean = True
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
            conn.detach_sink()  # the handler's buffers get nothing of a later stream
        # Let the caller close first (closing with its data still unread would reset the
        # connection and could destroy our last frames on the way), or end its half: then the
        # connection is kept for the caller's next stream.
        try:
            return await asyncio.wait_for(_until_end(conn, requests.ended), 2.0) and clean, caller
        except TimeoutError:
            logger.debug("bulk stream %s: the caller did not end its side within 2 s: closing", ticket.method)
            return False, caller

    def _reopened(self, caller: str, frame: bytes) -> _Ticket | None:
        """The stream a reopen frame asks for on `caller`'s connection, or None (malformed, or no
        bulk stream of that name)."""
        if len(frame) <= len(REOPEN_TAG) + 8 or not frame.startswith(REOPEN_TAG):
            return None
        (timeout,) = struct.unpack_from(">d", frame, len(REOPEN_TAG))
        try:
            method = frame[len(REOPEN_TAG) + 8:].decode()
        except UnicodeDecodeError:
            return None
        if method not in self.handlers or not (0 < timeout < 1e6):
            return None
        return _Ticket(caller, method, timeout, math.inf)


class _Requests:
    """The caller's messages of one stream, up to its END (`ended` says whether that came)."""

    def __init__(self, conn: FrameConnection) -> None:
        self.conn = conn
        self.ended = False

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> bytes | memoryview:
        if self.ended:
            raise StopAsyncIteration
        kind, payload = await self.conn.read_frame()
        if kind == END:
            self.ended = True
            raise StopAsyncIteration
        if kind != DATA:
            raise BulkProtocolError("the caller sent an ERROR frame")
        return payload


async def _until_end(conn: FrameConnection, ended: bool) -> bool:
    """Discards the caller's messages up to its END: True then, False when the connection closes."""
    try:
        while not ended:
            kind, _ = await conn.read_frame()
            ended = kind == END
        return True
    except BulkProtocolError:
        return False


async def connect(host: str, port: int, token: bytes, timeout: float, max_frame_bytes: int,
                  peer_id: str, tls: bool = True, handshake_timeout: float = 5.0,
                  dial: Callable[[float], Awaitable[socket.socket]] | None = None) -> FrameConnection:
    """Dials the callee's bulk port and presents the token; `PeerUnreachable` if it cannot be reached
    within `timeout` (nothing was sent then: the caller may fall back to gRPC). With `tls`, the
    connection is TLS 1.3 and the callee must prove `peer_id` (`swarm.net.tls`) within
    `handshake_timeout` more seconds (a loaded host may take longer than a TCP connect) before the
    token is sent. `dial(timeout)`, if given, makes the connected socket instead (a relay's circuit,
    docs/relay.md; it raises `PeerUnreachable` itself)."""
    loop = asyncio.get_running_loop()
    sock = await dial(timeout) if dial is not None else await _dial(host, port, timeout, peer_id)
    limit_unsent(sock)
    try:
        if tls:
            conn = FrameConnection(max_frame_bytes)
            _, sealed = await loop.create_connection(
                lambda: SealedProtocol(conn, client_context(peer_id), server_side=False, server_hostname=SERVER_NAME_BYTES),
                sock=sock)
            try:
                await asyncio.wait_for(asyncio.shield(sealed.ready), handshake_timeout)
            except BaseException:
                sealed.abort()
                raise
        else:
            _, conn = await loop.create_connection(lambda: FrameConnection(max_frame_bytes), sock=sock)
    except ssl.SSLCertVerificationError as e:
        sock.close()
        # someone else answers at the bulk port: the stream stays on the (verified) gRPC channel
        logger.warning("bulk port %s:%d does not prove %s (%s): not using it", host, port, peer_id, e.verify_message)
        raise PeerUnreachable(f"bulk port {host}:{port} is not {peer_id}'s ({e.verify_message})",
                              peer_id=peer_id) from None
    except (OSError, TimeoutError) as e:
        sock.close()
        raise PeerUnreachable(f"bulk port {host}:{port}: no TLS session ({type(e).__name__}: {e})",
                              peer_id=peer_id) from None
    conn.write_frame(DATA, token)
    return conn


def limit_unsent(sock: socket.socket | None) -> None:
    """Sets `NOTSENT_LOWAT` on a bulk connection's TCP socket (not on other kinds: a relay's circuit
    may be a Unix socket; nor where the platform lacks the option)."""
    option = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # 25: Linux's value (Python names it from 3.12 on)
    if not NOTSENT_LOWAT or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, NOTSENT_LOWAT)
    except (OSError, ValueError) as e:  # ValueError: closed meanwhile (no descriptor)
        logger.debug("TCP_NOTSENT_LOWAT not set on a bulk connection: %s", e)


async def _dial(host: str, port: int, timeout: float, peer_id: str) -> socket.socket:
    try:
        return await asyncio.wait_for(connected_socket(host, port), timeout)
    except (OSError, TimeoutError) as e:
        raise PeerUnreachable(f"bulk port {host}:{port} unreachable ({type(e).__name__}: {e})",
                              peer_id=peer_id) from None


async def exchange(
    conn: FrameConnection, requests: AsyncIterator[Frames] | Iterable[Frames], deadline: float, peer_id: str,
    method: str, on_sent: Callable[[int], None] | None = None, on_received: Callable[[int], None] | None = None,
    release: Callable[[FrameConnection], None] | None = None,
) -> AsyncIterator[bytes | memoryview]:
    """The caller's side of one bulk stream on a connection from `connect`: sends `requests`, yields
    the responses. Raises `DeadlineExceeded` past `deadline` (loop time), `PeerUnreachable` when the
    connection breaks, and the callee's error as the typed error its status maps to. A stream that
    ended cleanly both ways hands its connection to `release` (to carry a later stream: `reuse`)
    instead of closing it."""
    loop = asyncio.get_running_loop()
    expired = False
    clean = False

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
                    raise cast(BaseException, sender.exception()) from None  # the request iterator failed
                raise PeerUnreachable(f"bulk stream broke: {e} ({method} on {peer_id})", peer_id=peer_id) from None
            if kind == END:
                clean = sender.done() and not sender.cancelled() and sender.exception() is None and conn.idle
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
        if clean and release is not None and not expired:
            conn.detach_sink()
            conn.stream_base = conn.read_data_frames
            conn.trim()
            release(conn)
        else:
            if release is not None:
                logger.debug("bulk stream %s to %s: connection closed (%s)", method, peer_id,
                             "deadline" if expired else "ended before both ENDs" if not clean else "no release")
            conn.abort()


def reuse(conn: FrameConnection, token: bytes) -> bool:
    """Starts a stream on a kept-alive connection (from `exchange`'s `release`) by sending its token;
    False when the connection is no longer usable (closed by the callee, which may have restarted,
    or sent something unasked): the caller then dials a fresh one with the same token."""
    if not conn.idle or not _socket_open(conn):
        conn.abort()
        return False
    conn.write_frame(DATA, token)
    return True


def reopen(conn: FrameConnection, method: str, timeout: float) -> bool:
    """Starts a stream of `method` on a kept-alive connection whose callee takes reopen frames
    (`BulkOpenResponse.reopen`), with no OpenBulk call; False (the connection closed) as `reuse`."""
    if not conn.idle or not _socket_open(conn):
        conn.abort()
        return False
    conn.write_frame(DATA, REOPEN_TAG + struct.pack(">d", timeout) + method.encode())
    return True


def _socket_open(conn: FrameConnection) -> bool:
    """Whether the kernel still holds the connection open with nothing unread: catches a callee's
    close (a FIN or a reset already arrived) that the event loop has not processed yet."""
    sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
    if sock is None:
        return True
    try:
        probe = socket.socket(fileno=os.dup(sock.fileno()))
    except OSError:
        return False
    try:
        probe.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        return False  # closed (b""), or bytes nobody asked for
    except BlockingIOError:
        return True  # open, nothing to read
    except OSError:
        return False  # reset
    finally:
        probe.close()


def _length(message: Frames) -> int:
    return sum(len(part) for part in message) if isinstance(message, tuple | list) else len(message)


async def _send(conn: FrameConnection, requests: AsyncIterator[Frames] | Iterable[Frames],
                on_sent: Callable[[int], None] | None) -> None:
    try:
        if isinstance(requests, AsyncIterable):
            async for message in requests:
                conn.write_frame(DATA, message)
                if on_sent is not None:
                    on_sent(_length(message))
                await conn.drain()
        else:
            for message in requests:
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
