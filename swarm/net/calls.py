"""Unary calls multiplexed on one long-lived gRPC stream per caller and callee.

A message on a stream that is already open costs much less than a small unary call (figures in
benchmarks/history/BENCHMARKS-2026-12-05.md, "Multiplexed calls"): a unary call sets up and tears down an HTTP/2 stream, its
headers and a task on both sides every time. So a caller opens `/swarm.Peer/Calls` once per callee (authenticated by its
ticket, like any call) and sends each small unary call on it as a `CallRequest`; the callee runs
the handler registered for that method, exactly as for a unary call (same decoding, same
`CallContext`, same errors), and answers with a `CallResponse` carrying the request's id, so calls
overlap and finish in any order. A stream message holds every request (or response) that was
waiting while the previous message was being written, so a busy stream sends few large messages
instead of many small ones, and an idle one sends each call at once.

What stays as it was: every error is the typed error a unary call would raise (the status travels
in the response); a deadline is the caller's (the callee gets it too and stops the handler when it
passes); a caller whose stream breaks fails its calls in flight with the stream's status and opens
a new stream for the next call; large requests and callees that do not know the method (older
versions) use plain unary calls, as does a call whose stream the callee did not accept.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import Message

from swarm.core.errors import ResourceExhausted, SwarmError
from swarm.core.loop import spawn
from swarm.net.errors import from_status, to_status
from swarm.proto import peer_pb2

logger = logging.getLogger(__name__)

CALLS = "/swarm.Peer/Calls"
ACCEPTED = ("swarm-calls", "1")
"""The initial metadata with which a callee accepts a Calls stream."""
MAX_MULTIPLEXED_REQUEST = 256 << 10
"""Requests up to this many bytes travel on the stream; larger ones as unary calls of their own
(a large message would hold up the small ones queued behind it)."""
_MAX_BATCH_BYTES = 1 << 20  # a stream message holds items up to this size in all, or one larger item

_CORE_OP_FAILED = "Internal error from Core"  # grpc.aio's status for a stream whose own operation failed
_OK = grpc.StatusCode.OK.value[0]
_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

__all__ = ["ACCEPTED", "CALLS", "MAX_MULTIPLEXED_REQUEST", "Admission", "CallStream", "StreamRefused", "serve_calls"]


class StreamRefused(Exception):
    """The callee did not accept the Calls stream, so the call reached no handler: send it as a
    unary call of its own, which also reports the callee's own status if it fails again (gRPC may
    end a refused stream with a bare INTERNAL error). `unsupported`: the callee has no Calls
    method at all (an older version), so later calls should not try a stream."""

    def __init__(self, message: str, unsupported: bool) -> None:
        super().__init__(message)
        self.unsupported = unsupported


def _ignore(_error: BaseException) -> None:
    pass


def _status(number: int) -> grpc.StatusCode:
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


class _Outbox:
    """Writes queued items to a stream, one message at a time, each holding all that waited.

    `put` never waits: a writer task sends what is queued and sleeps when nothing is. A failed
    write ends the outbox (`on_error` learns why); items put after that are dropped.
    """

    def __init__(self, write: Callable[[bytes], Awaitable[object]], batch: type, on_error: Callable[[BaseException], None],
                 name: str, ready: Callable[[], Awaitable[object]] | None = None) -> None:
        self._write = write
        self._ready = ready
        self._batch = batch
        self._on_error = on_error
        self._queue: list[Message] = []
        self._size = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing queued and no write in progress
        self._idle.set()
        self._task = spawn(self._run(), name=name)

    def put(self, item: Message, size: int) -> None:
        self._queue.append(item)
        self._size += size
        self._idle.clear()
        self._wake.set()

    async def _run(self) -> None:
        try:
            if self._ready is not None:
                await self._ready()
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queue:
                    items, self._queue, self._size = self._take()
                    await self._write(self._batch(calls=items).SerializeToString())
                self._idle.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stream is gone: the owner fails what waits on it
            self._on_error(e)
        finally:
            self._idle.set()

    def _take(self) -> tuple[list[Message], list[Message], int]:
        """The items for the next message: all, or as many as fit in `_MAX_BATCH_BYTES` (one at
        least), so that a message is never much larger than the largest single item."""
        if self._size <= _MAX_BATCH_BYTES:
            return self._queue, [], 0
        taken, size = 0, 0
        for item in self._queue:
            item_size = item.ByteSize()
            if taken and size + item_size > _MAX_BATCH_BYTES:
                break
            taken += 1
            size += item_size
        rest = self._queue[taken:]
        return self._queue[:taken], rest, sum(item.ByteSize() for item in rest)

    def close(self) -> None:
        self._task.cancel()

    async def drain(self) -> None:
        """Waits until everything queued was written (or the outbox ended)."""
        await self._idle.wait()


# -- caller side --------------------------------------------------------------------------------


class CallStream:
    """The caller's end of one Calls stream (opened by `PeerChannel`, which replaces it once broken).

    A stream with no call for `idle_timeout` seconds ends itself (the callee holds one open gRPC
    call per stream, and its server caps those): the next call opens a new one.

    Args:
        channel: The gRPC channel to the callee.
        metadata: The call metadata (the caller's ticket).
        peer_id: The callee's PeerID, for error messages.
        idle_timeout: Seconds without calls after which the stream ends.
    """

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, bytes], ...], peer_id: str,
                 idle_timeout: float = 60.0) -> None:
        self.peer_id = peer_id
        self._loop = asyncio.get_running_loop()
        self._idle_timeout = idle_timeout
        self._last_used = self._loop.time()
        self._idle_timer = self._loop.call_later(idle_timeout, self._close_if_idle)
        self._call = channel.stream_stream(CALLS)(metadata=metadata)
        self._pending: dict[int, asyncio.Future[peer_pb2.CallResponse | None]] = {}
        self._next_id = 0
        self._ended: tuple[grpc.StatusCode, str] | None = None  # why the stream ended
        self._accepted = False  # the callee accepted the stream (sent `ACCEPTED`)
        # the first write waits for the callee to accept the stream: writing to a stream it refused
        # would end the call with an INTERNAL error instead of the callee's status (UNAUTHENTICATED,
        # UNIMPLEMENTED); a write that fails means the call is over, and its reader learns the status
        self._outbox = _Outbox(self._call.write, peer_pb2.CallRequests, _ignore, f"calls-to-{peer_id[-8:]}",
                               ready=self._call.wait_for_connection)
        self._reader = spawn(self._read_responses(), name=f"calls-from-{peer_id[-8:]}")

    async def accepted(self) -> tuple[tuple[str, str | bytes], ...] | None:
        """The callee's initial metadata once it accepted the stream; None if it refused it."""
        try:
            metadata = await self._call.initial_metadata()
        except grpc.aio.AioRpcError:
            return None
        metadata = tuple(metadata or ())
        return metadata if any(key == ACCEPTED[0] for key, _ in metadata) else None

    @property
    def broken(self) -> bool:
        """The stream ended: no call may use it."""
        return self._ended is not None

    def _error(self, method: str) -> Exception:
        """A fresh error for a call that met the stream's end."""
        code, details = self._ended or (grpc.StatusCode.UNAVAILABLE, "call stream closed")
        if not self._accepted:
            return StreamRefused(f"{code.name}: {details}", unsupported=code == grpc.StatusCode.UNIMPLEMENTED)
        return from_status(code, details, self.peer_id, method)

    async def call(self, method: str, payload: bytes, timeout: float) -> bytes:
        """Sends one request and waits, at most `timeout` seconds, for its response payload.

        Raises:
            RPCError: the callee's status, the stream's failure, or `DeadlineExceeded`.
            StreamRefused: the callee did not accept the stream (the request reached no handler).
        """
        if self._ended is not None:
            raise self._error(method)
        self._next_id += 1
        call_id = self._next_id
        self._last_used = self._loop.time()
        future = self._pending[call_id] = self._loop.create_future()
        self._outbox.put(peer_pb2.CallRequest(id=call_id, method=method, payload=payload, timeout=timeout),
                         len(payload) + len(method) + 16)
        try:
            async with asyncio.timeout(timeout):
                response = await future
        except TimeoutError:
            raise from_status(grpc.StatusCode.DEADLINE_EXCEEDED, f"no response within {timeout:.3g} s",
                              self.peer_id, method) from None
        finally:
            self._pending.pop(call_id, None)
        if response is None:
            raise self._error(method)
        if response.code != _OK:
            raise from_status(_status(response.code), response.details, self.peer_id, method)
        return response.payload

    async def _read_responses(self) -> None:
        error: BaseException | None = None
        try:
            metadata = await self._call.initial_metadata()  # a refused stream has none but its status
            self._accepted = any(key == ACCEPTED[0] for key, _ in metadata or ())
            while True:
                data = await self._call.read()
                if data is grpc.aio.EOF:
                    break
                try:
                    responses = peer_pb2.CallResponses.FromString(data).calls
                except Exception as e:  # noqa: BLE001 - a lying peer
                    error = ValueError(f"malformed call response: {e}")
                    self._call.cancel()
                    break
                pending = self._pending
                for response in responses:
                    future = pending.get(response.id)
                    if future is not None and not future.done():
                        future.set_result(response)
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = asyncio.CancelledError()
            raise
        finally:
            self._end(error)

    def _end(self, error: BaseException | None) -> None:
        """Marks the stream ended; every call in flight, and every later one, fails with its status."""
        if self._ended is not None:
            return
        if isinstance(error, grpc.aio.AioRpcError):
            self._ended = (error.code(), error.details() or error.code().name)
            if error.code() == grpc.StatusCode.INTERNAL and (error.details() or "").startswith(_CORE_OP_FAILED):
                # an operation of this stream failed inside gRPC (a write to a connection that
                # broke, as when the callee was killed): gone, as a unary call would report it
                self._ended = (grpc.StatusCode.UNAVAILABLE, "the connection to the callee broke")
        elif isinstance(error, asyncio.CancelledError):
            # the caller closed the channel (`ChannelPool.forget`): the callee is out of reach for it
            self._ended = (grpc.StatusCode.UNAVAILABLE, "the channel was closed")
        elif isinstance(error, ValueError):
            self._ended = (grpc.StatusCode.INTERNAL, str(error))
        else:
            self._ended = (grpc.StatusCode.UNAVAILABLE, "the call stream closed")
        for future in self._pending.values():
            if not future.done():
                future.set_result(None)
        self._outbox.close()
        self._idle_timer.cancel()

    def _close_if_idle(self) -> None:
        if self._ended is not None:
            return
        idle_for = self._loop.time() - self._last_used
        if self._pending or idle_for < self._idle_timeout:
            self._idle_timer = self._loop.call_later(self._idle_timeout - min(idle_for, self._idle_timeout / 2),
                                                     self._close_if_idle)
            return
        self._ended = (grpc.StatusCode.UNAVAILABLE, "the call stream was closed after being idle")
        spawn(self._finish(), name=f"calls-to-{self.peer_id[-8:]}-idle")

    async def _finish(self) -> None:
        """Ends an idle stream cleanly: the callee reads its end and answers OK."""
        await self._outbox.drain()
        self._outbox.close()
        try:
            await self._call.done_writing()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass

    def close(self) -> None:
        """Cancels the stream; the calls in flight on it fail at once (the channel was closed)."""
        self._idle_timer.cancel()
        self._call.cancel()
        self._reader.cancel()
        # a reader cancelled before it first ran never reaches its `_end`: the calls would wait out their timeouts
        self._end(asyncio.CancelledError())


# -- callee side --------------------------------------------------------------------------------


Invoke = Callable[[str, bytes, grpc.aio.ServicerContext, float | None], Awaitable[bytes]]
"""`invoke(method, payload, context, deadline) -> response bytes`: runs a registered unary handler
for the caller of `context` (raising what the handler raised)."""


class Admission:
    """The calls a server runs at once, across all its Calls streams, against one cap."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running = 0


async def serve_calls(
    context: grpc.aio.ServicerContext, invoke: Invoke, known: Callable[[str], bool], admission: Admission,
    max_response_bytes: int, readers: set[asyncio.Task[None]],
) -> None:
    """Serves one Calls stream until the caller ends it or the server stops.

    Args:
        context: The stream's servicer context (the caller is already authenticated).
        invoke: Runs a registered handler.
        known: Whether a method path has a unary handler.
        admission: The server's cap on calls running at once; past it a call gets RESOURCE_EXHAUSTED.
        max_response_bytes: Largest response payload.
        readers: The server's running stream readers: cancelling one ends its stream.
    """
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task[None]] = set()
    failed: list[BaseException] = []
    outbox = _Outbox(context.write, peer_pb2.CallResponses, failed.append, "calls-responses")

    def respond(response: peer_pb2.CallResponse) -> None:
        outbox.put(response, len(response.payload) + len(response.details) + 16)

    async def run(request: peer_pb2.CallRequest) -> None:
        deadline = loop.time() + request.timeout if request.timeout > 0 else None
        try:
            async with asyncio.timeout_at(deadline):
                payload = await invoke(request.method, request.payload, context, deadline)
            if len(payload) > max_response_bytes:
                raise ResourceExhausted(f"response of {len(payload)} bytes exceeds the {max_response_bytes}-byte limit")
            respond(peer_pb2.CallResponse(id=request.id, payload=payload))
        except TimeoutError:
            respond(_error(request.id, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed on the callee"))
        except Exception as e:  # every failure becomes a status, never a dead stream
            code = to_status(e)
            if code is None:
                logger.exception("handler %s failed", request.method, exc_info=e)
                respond(_error(request.id, grpc.StatusCode.INTERNAL,
                               f"internal error in {request.method}: {type(e).__name__}: {e}"))
            else:
                if isinstance(e, SwarmError):
                    logger.debug("%s refused a call: %s", request.method, e)
                respond(_error(request.id, code, str(e)))

    def finished(task: asyncio.Task[None]) -> None:
        running.discard(task)
        admission.running -= 1

    malformed: list[str] = []

    async def read_requests() -> None:
        while not failed:
            data = await context.read()
            if data is grpc.aio.EOF:
                return
            try:
                requests = peer_pb2.CallRequests.FromString(data).calls
            except Exception as e:  # noqa: BLE001
                malformed.append(f"malformed call request: {e}")
                return
            for request in requests:
                if not known(request.method):
                    respond(_error(request.id, grpc.StatusCode.UNIMPLEMENTED, f"no method {request.method}"))
                elif admission.running >= admission.limit:
                    respond(_error(request.id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"the callee runs {admission.limit} calls already"))
                else:
                    admission.running += 1
                    task = asyncio.ensure_future(run(request))
                    running.add(task)
                    task.add_done_callback(finished)

    # the server stops a stream by cancelling its reader: the calls taken are answered and the
    # stream ends with OK, so that neither side waits for it
    reader = asyncio.ensure_future(read_requests())
    readers.add(reader)
    try:
        await reader
    except asyncio.CancelledError:
        if not reader.cancelled() or asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise
    finally:
        readers.discard(reader)
        reader.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        await outbox.drain()
        outbox.close()
    if malformed:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed[0])


def _error(call_id: int, code: grpc.StatusCode, details: str) -> peer_pb2.CallResponse:
    return peer_pb2.CallResponse(id=call_id, code=code.value[0], details=details)
