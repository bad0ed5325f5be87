"""The peer's one gRPC server: every service on one TCP port, every call authenticated.

The port speaks TLS 1.3 with a certificate issued by the peer's libp2p key (`swarm.net.tls`),
unless the operator turned TLS off (`ServerConfig.tls`, `--insecure`).

Services register plain coroutine handlers by method path (`/swarm.DHT/Find`); the server wraps
each one once with what every call needs: the caller's PeerID from its ticket, decoding of the
request with a clear INVALID_ARGUMENT on garbage, and translation of swarm errors into statuses.
Handlers may be added after the server started (dispatch looks them up per call).

Identities cost nothing, so limits per caller (PeerID) do not hold back one host that brings many.
Every call therefore also names its *source*: the network prefix it came from (`source_of`: the
caller's IPv4 /24 or IPv6 /64 by default), which services limit too (the expert server's
`max_inflight_per_source`). Sources in `ServerConfig.source_exempt` (loopback by default, so local
tests and one-host setups behave as before) are named "" and limited by nothing but the totals.

Every call, whatever its service and path (unary, stream, multiplexed on a Calls stream, or over
the bulk side channel), is admitted by one `swarm.net.limits.CallLimiter` first: calls in flight
per source network and per caller over the whole server (`max_inflight_per_source`,
`max_inflight_per_caller`), Calls streams per source (`max_call_streams_per_source`), and the
`CallLimit` a service registered a method with (the DHT's Store and Find, the averaging streams).
A refused call gets RESOURCE_EXHAUSTED naming the limit, before its handler runs.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError, Message

from swarm.core.errors import ConfigError, InvalidRequest, NotFound, SwarmError, Unauthenticated
from swarm.core.identity import Identity
from swarm.core.multiaddr import Multiaddr
from swarm.metrics.rpc import MethodMetrics, RPCMetrics  # metrics
from swarm.net.auth import TicketVerifier
from swarm.net.bulk import OPEN_BULK, BulkListener, Sink
from swarm.net.calls import ACCEPTED, CALLS, Admission, serve_calls
from swarm.net.errors import to_status
from swarm.net.frames import FrameConnection, Frames
from swarm.net.limits import CallLimit, CallLimiter
from swarm.net.membership import MEMBERSHIP, MembershipGate, address_of
from swarm.net.membership import METADATA_KEY as MEMBERSHIP_KEY
from swarm.net.tls import PeerCertificate, server_context
from swarm.proto import peer_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """Limits of the peer's gRPC server.

    Attributes:
        max_message_bytes: largest single message accepted or sent (tensors travel in ~1 MiB chunks).
        max_concurrent_rpcs: calls in flight at once; past it new calls get RESOURCE_EXHAUSTED.
        max_concurrent_streams: HTTP/2 streams per connection.
        shutdown_grace: seconds in-flight calls get to finish when the server stops.
        bulk: open the bulk side channel (`swarm.net.bulk`) for streams registered with
            ``bulk=True``; without it they run over gRPC only (one port, slower tensors).
        bulk_port: the side channel's TCP port (0: any free port); a peer behind a port
            mapping publishes it too, or its callers fall back to gRPC.
        max_call_streams: Calls streams (`swarm.net.calls`) open at once; each holds one of the
            `max_concurrent_rpcs` slots for as long as its caller keeps it. Past it a caller is
            refused the stream and sends its calls as unary calls of their own. 0: half of
            `max_concurrent_rpcs`.
        tls: serve TLS 1.3 on both ports with a certificate issued by the peer's libp2p key
            (`swarm.net.tls`, docs/security.md). False (`--insecure`) serves plaintext, which only
            callers that are also insecure can talk to: for a closed cluster.
        source_prefix_v4: bits of an IPv4 caller's address that name its source (24: a /24).
        source_prefix_v6: bits of an IPv6 caller's address that name its source (64: a /64).
        source_exempt: networks whose callers have no source (no limits per source): loopback by
            default; () limits every caller, e.g. a peer that relays others' traffic.
        max_inflight_per_source: calls in flight at once from one source network, over every
            method (`swarm.net.limits`); past it its calls get RESOURCE_EXHAUSTED at once.
        max_inflight_per_caller: calls in flight at once from one caller (PeerID), over every method.
        max_call_streams_per_source: Calls streams open at once from one source network.
    """

    max_message_bytes: int = 8 << 20
    max_concurrent_rpcs: int = 2048
    max_concurrent_streams: int = 512
    shutdown_grace: float = 2.0
    bulk: bool = True
    bulk_port: int = 0
    max_call_streams: int = 0
    tls: bool = True
    source_prefix_v4: int = 24
    source_prefix_v6: int = 64
    source_exempt: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    max_inflight_per_source: int = 512
    max_inflight_per_caller: int = 512
    max_call_streams_per_source: int = 32

    def __post_init__(self) -> None:
        if self.max_message_bytes < (1 << 20) + 4096:
            raise ConfigError("max_message_bytes must hold a 1 MiB chunk")
        if self.max_concurrent_rpcs < 1 or self.max_concurrent_streams < 1:
            raise ConfigError("concurrency limits must be positive")
        if min(self.max_inflight_per_source, self.max_inflight_per_caller, self.max_call_streams_per_source) < 1:
            raise ConfigError("max_inflight_per_source, max_inflight_per_caller and "
                              "max_call_streams_per_source must be positive")
        if not (0 <= self.source_prefix_v4 <= 32 and 0 <= self.source_prefix_v6 <= 128):
            raise ConfigError("source_prefix_v4 must be in 0..32 and source_prefix_v6 in 0..128")
        try:
            _networks(tuple(self.source_exempt))
        except ValueError as e:
            raise ConfigError(f"source_exempt: {e}") from None


@functools.lru_cache(maxsize=16)
def _networks(nets: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(net, strict=False) for net in nets)


def source_of(peer: str, config: ServerConfig) -> str:
    """The source of a call from grpc's `context.peer()` ("ipv4:10.1.2.3:5000", "ipv6:[2001:db8::1]:5000"):
    the network it came from, e.g. "10.1.2.0/24"; "" for an exempt or unknown one (a Unix socket).

    IPv4 callers seen through an IPv6 socket (``::ffff:a.b.c.d``) count as IPv4.
    """
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]")
    else:
        return ""
    return source_of_host(host, config)


def source_of_host(host: str, config: ServerConfig) -> str:
    """The source network of a caller's IP address ("10.1.2.3" -> "10.1.2.0/24"); "" if exempt or not an IP."""
    return network_of(host, tuple(config.source_exempt), config.source_prefix_v4, config.source_prefix_v6)


def network_of(host: str, exempt: tuple[str, ...], bits_v4: int, bits_v6: int) -> str:
    """The /`bits_v4` (/`bits_v6`) network of an IP address, "" if it lies in an `exempt` network or
    is not an IP; IPv4 seen as IPv6 (``::ffff:a.b.c.d``) counts as IPv4. Also the DHT's diversity
    filter's (`swarm/dht/diversity.py`)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return ""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address.version == net.version and address in net for net in _networks(exempt)):
        return ""
    bits = bits_v4 if address.version == 4 else bits_v6
    return str(ipaddress.ip_network(f"{address}/{bits}", strict=False))


@dataclass(frozen=True)
class CallContext:
    """What a handler knows about the call: the authenticated caller, and the gRPC context (None
    for a stream on the bulk side channel; the Calls stream's for a multiplexed call). Calls that
    did not come as gRPC calls of their own have a `deadline` in loop time instead."""

    peer_id: str
    grpc_context: grpc.aio.ServicerContext | None
    deadline: float | None = None
    connection: FrameConnection | None = None  # the bulk side channel's connection, if the call came over it
    source: str = ""  # the network the call came from (`source_of`); "" when exempt or unknown

    def receive_into(self, sink: Sink) -> bool:
        """Lets a `swarm.net.bulk.Sink` place the payloads of the later request messages (the first
        message after this call is index 0 only if none arrived yet: the sink sees each message's
        index in the stream). False, changing nothing, for a call over gRPC."""
        if self.connection is None:
            return False
        sink.attach(self.connection, offset=1)  # the connection's first message was its token
        return True

    def time_remaining(self) -> float | None:
        if self.deadline is not None:
            return max(0.0, self.deadline - asyncio.get_running_loop().time())
        if self.grpc_context is not None:
            return self.grpc_context.time_remaining()
        return None


Response: TypeAlias = Message | Frames
"""What a handler may answer with: a message, its encoding, or buffers sent back to back."""
UnaryHandler = Callable[[Any, CallContext], Awaitable[object]]  # Any: each handler takes its own request type
StreamHandler = Callable[[AsyncIterator[bytes], CallContext], AsyncIterator[Response]]


def _serialize(response: Response) -> bytes:
    """The bytes gRPC sends for a response: itself, a message's encoding, or joined buffers."""
    if isinstance(response, bytes):
        return response
    if isinstance(response, tuple | list):
        return b"".join(response)
    if isinstance(response, bytearray | memoryview):
        return bytes(response)
    return response.SerializeToString()


def as_frame(response: Response) -> Frames:
    """What the bulk side channel sends for a response: buffers as they are, a message's encoding."""
    if isinstance(response, bytes | bytearray | memoryview | tuple | list):
        return response
    return response.SerializeToString()


def frame_length(message: Frames) -> int:
    """Bytes in a message that may be a tuple of buffers."""
    return sum(len(part) for part in message) if isinstance(message, tuple | list) else len(message)


def _decode(request_type: type[Message] | None, data: bytes) -> Any:
    if request_type is None:
        return data
    try:
        return request_type.FromString(data)
    except DecodeError as e:
        raise InvalidRequest(f"malformed {request_type.__name__}: {e}") from None


async def _abort(context: grpc.aio.ServicerContext, error: BaseException, path: str) -> None:
    code = to_status(error)
    if code is None:
        logger.exception("handler %s failed", path, exc_info=error)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {path}: {type(error).__name__}: {error}")
    else:
        if isinstance(error, SwarmError):
            logger.debug("%s refused a call: %s", path, error)
        await context.abort(code, str(error))


class _Dispatcher(grpc.GenericRpcHandler):
    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self.handlers.get(handler_call_details.method)


class RPCServer:
    """One grpc.aio server per peer; `await start(listen)` binds it (port 0 picks a free port)."""

    def __init__(self, identity: Identity, config: ServerConfig | None = None, *,
                 certificate: PeerCertificate | None = None, gate: MembershipGate | None = None) -> None:
        self.identity = identity
        self.gate = gate
        """A private swarm's gate (`swarm.net.membership`): every authenticated call's caller must
        prove membership. None: an open swarm."""
        self.config = config or ServerConfig()
        # the TLS certificate (None with tls=False); `certificate` replaces the one issued here
        self.certificate = certificate if self.config.tls else None
        self.verifier = TicketVerifier(identity.peer_id)
        self._dispatcher = _Dispatcher()
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics = RPCMetrics("server")  # metrics
        self.bulk: BulkListener[CallContext] = BulkListener({}, self._bulk_context, self.config.max_message_bytes)
        self.limiter = CallLimiter(self.config.max_inflight_per_source, self.config.max_inflight_per_caller)
        """Admits every call (`swarm.net.limits`): what one source network or caller runs at once."""
        self._unary: dict[str, tuple[UnaryHandler, type[Message] | None, bool, MethodMetrics, CallLimit | None]] = {}
        self._call_streams: set[asyncio.Task[None]] = set()  # the readers of open Calls streams
        self._call_streams_by_source: dict[str, int] = {}
        self._calls_admission = Admission(self.config.max_concurrent_rpcs)
        self._dispatcher.handlers[CALLS] = grpc.stream_stream_rpc_method_handler(self._serve_calls)
        self.add_unary(OPEN_BULK, self._open_bulk, peer_pb2.BulkOpenRequest)
        if gate is not None:
            self.add_unary(MEMBERSHIP, self._membership)

    # -- registration -------------------------------------------------------------------------

    def _bulk_context(self, caller: str, deadline: float, conn: FrameConnection) -> CallContext:
        """The context of a stream over the bulk side channel, its source read from the socket."""
        transport = conn.transport
        peername = transport.get_extra_info("peername") if transport is not None else None
        source = source_of_host(str(peername[0]), self.config) if isinstance(peername, tuple) and peername else ""
        return CallContext(caller, None, deadline, conn, source=source)

    def _source(self, context: grpc.aio.ServicerContext) -> str:
        return source_of(context.peer() or "", self.config)

    def _caller(self, context: grpc.aio.ServicerContext, authenticated: bool, method: str = "") -> str:
        if not authenticated:
            return ""
        metadata = context.invocation_metadata()
        caller = self.verifier.caller_of(metadata)
        if self.gate is not None:
            self.gate.admit(caller, metadata, address_of(context.peer() or ""), method)
        return caller

    async def _respond(
        self, path: str, stats: MethodMetrics, context: grpc.aio.ServicerContext, authenticated: bool,
        invoke: Callable[[CallContext], Awaitable[object]], limit: CallLimit | None,
    ) -> bytes:
        """One response for one call: authenticate, admit, run the handler, map failures to statuses."""
        try:
            return await _handle(stats, lambda: CallContext(self._caller(context, authenticated, path), context,
                                                            source=self._source(context)), invoke,
                                 self.limiter, limit)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes a status, never a dead server
            await _abort(context, e, path)
            raise AssertionError("unreachable") from None

    def add_unary(
        self, path: str, handler: UnaryHandler, request_type: type[Message] | None = None, *, authenticated: bool = True,
        limit: CallLimit | None = None,
    ) -> None:
        """Registers `handler(request, ctx) -> response` for unary calls to `path`; `limit` bounds
        what one source network or caller runs of it (`swarm.net.limits`)."""

        stats = self.metrics.method(path)  # metrics: bound once, incremented per call

        async def behavior(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            stats.received.value += len(request)  # metrics
            return await self._respond(
                path, stats, context, authenticated, lambda ctx: handler(_decode(request_type, request), ctx), limit
            )

        self._dispatcher.handlers[path] = grpc.unary_unary_rpc_method_handler(behavior)
        self._unary[path] = (handler, request_type, authenticated, stats, limit)

    async def _serve_calls(self, _requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """One caller's Calls stream (`swarm.net.calls`): its small unary calls, multiplexed."""
        try:
            caller = self._caller(context, True)
        except Unauthenticated as e:  # PermissionDenied too: not a member of a private swarm
            await context.abort(to_status(e) or grpc.StatusCode.UNAUTHENTICATED, str(e))
        limit = self.config.max_call_streams or max(1, self.config.max_concurrent_rpcs // 2)
        if len(self._call_streams) >= limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{limit} call streams are open already")
        origin = self._source(context)
        by_source = self._call_streams_by_source
        if origin:
            opened = by_source.get(origin, 0)
            if opened >= self.config.max_call_streams_per_source:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{opened} call streams are open from your network {origin}, "
                                    f"the server's limit per source address")
            by_source[origin] = opened + 1
        try:
            # the caller may write now (swarm.net.calls); in a private swarm it checks this peer's proof first
            await context.send_initial_metadata((ACCEPTED,) if self.gate is None else
                                                (ACCEPTED, (MEMBERSHIP_KEY, self.gate.policy.proof)))
            unary, limiter, gate = self._unary, self.limiter, self.gate
            metadata, address = context.invocation_metadata(), address_of(context.peer() or "")

            def context_for(path: str, stream: grpc.aio.ServicerContext, deadline: float | None,
                            authenticated: bool) -> CallContext:
                if gate is not None:  # each call: a member may have expired or been revoked since the stream opened
                    gate.admit(caller, metadata, address, path)
                return CallContext(caller if authenticated else "", stream, deadline, source=origin)

            async def invoke(path: str, payload: bytes, stream: grpc.aio.ServicerContext, deadline: float | None) -> bytes:
                handler, request_type, authenticated, stats, method_limit = unary[path]
                stats.received.value += len(payload)  # metrics
                return await _handle(stats, lambda: context_for(path, stream, deadline, authenticated),
                                     lambda ctx: handler(_decode(request_type, payload), ctx), limiter, method_limit)

            await serve_calls(context, invoke, unary.__contains__, self._calls_admission,
                              self.config.max_message_bytes - 64, self._call_streams)
        finally:
            if origin:
                left = by_source.get(origin, 1) - 1
                if left:
                    by_source[origin] = left
                else:
                    by_source.pop(origin, None)

    def add_stream(self, path: str, handler: StreamHandler, *, request_streaming: bool = True,
                   bulk: bool = False, limit: CallLimit | None = None) -> None:
        """Registers `handler(request_iterator, ctx)`, an async generator of responses (bytes or messages).

        Requests arrive as raw bytes (a header, then tensor chunks). With `request_streaming=False`
        the handler still receives an async iterator, holding the single request. With `bulk=True`
        callers may also reach it over the bulk side channel (`swarm.net.bulk`; `stream(bulk=True)`).
        `limit` bounds what one source network or caller runs of it at once (`swarm.net.limits`).
        """

        stats = self.metrics.method(path)  # metrics
        limiter = self.limiter
        if bulk:
            async def bulk_behavior(requests: AsyncIterator[bytes], ctx: CallContext) -> AsyncGenerator[Frames, None]:
                if self.gate is not None:  # its token came from a checked OpenBulk; a kept connection's
                    self.gate.still_member(ctx.peer_id, path)  # reopen frame did not: it may be revoked since
                limiter.admit(limit, ctx.peer_id, ctx.source)
                started, ok = stats.start(), False  # metrics
                try:
                    async for response in handler(_counted(requests, stats), ctx):
                        data = as_frame(response)
                        stats.sent.value += frame_length(data)  # metrics
                        yield data
                    ok = True
                finally:
                    stats.finish(started, ok)  # metrics
                    limiter.release(limit, ctx.peer_id, ctx.source)

            self.bulk.handlers[path] = bulk_behavior

        async def behavior(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            started, ok = stats.start(), False  # metrics
            admitted: tuple[str, str] | None = None
            try:
                caller, origin = self._caller(context, True, path), self._source(context)
                limiter.admit(limit, caller, origin)
                admitted = (caller, origin)
                source = _counted(requests, stats) if request_streaming else _single(requests, stats)
                async for response in handler(source, CallContext(caller, context, source=origin)):
                    data = _serialize(response)
                    stats.sent.value += len(data)  # metrics
                    yield data
                ok = True
            except grpc.aio.AbortError:
                raise
            except Exception as e:  # noqa: BLE001
                await _abort(context, e, path)
            finally:
                stats.finish(started, ok)  # metrics
                if admitted is not None:
                    limiter.release(limit, *admitted)

        factory = grpc.stream_stream_rpc_method_handler if request_streaming else grpc.unary_stream_rpc_method_handler
        self._dispatcher.handlers[path] = factory(behavior)

    def add_stream_unary(self, path: str, handler: Callable[[AsyncIterator[bytes], CallContext], Awaitable[object]], *,
                         limit: CallLimit | None = None) -> None:
        """Registers `handler(request_iterator, ctx) -> response` for client-streaming calls."""

        stats = self.metrics.method(path)  # metrics

        async def behavior(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
            return await self._respond(path, stats, context, True, lambda ctx: handler(_counted(requests, stats), ctx),
                                       limit)

        self._dispatcher.handlers[path] = grpc.stream_unary_rpc_method_handler(behavior)

    async def _membership(self, request: bytes, ctx: CallContext) -> bytes:
        """This peer's membership proof, for a caller whose own proof the gate just accepted."""
        if self.gate is None:
            raise NotFound("this peer runs an open swarm")
        return self.gate.policy.proof

    async def _open_bulk(self, request: peer_pb2.BulkOpenRequest, ctx: CallContext) -> peer_pb2.BulkOpenResponse:
        token = self.bulk.issue(ctx.peer_id, request.method, request.timeout)
        return peer_pb2.BulkOpenResponse(port=self.bulk.port or 0, token=token, reopen=self.bulk.reopen)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, listen: Multiaddr) -> int:
        """Binds and starts serving; returns the bound port. A taken port fails loudly."""
        cfg = self.config
        self._server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ],
            maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
        )
        self._server.add_generic_rpc_handlers((self._dispatcher,))
        target = listen.grpc_target
        if listen.protocol in ("dns", "dns4", "dns6"):
            raise ConfigError(f"listen on an IP address, not a DNS name ({listen}); announce DNS names instead")
        if cfg.tls and self.certificate is None:
            self.certificate = PeerCertificate.issue(self.identity)
        try:
            if self.certificate is not None:
                credentials = grpc.ssl_server_credentials(
                    [(self.certificate.key_pem, self.certificate.certificate_pem)])
                port = self._server.add_secure_port(target, credentials)
            else:
                port = self._server.add_insecure_port(target)
        except RuntimeError as e:
            raise ConfigError(f"cannot listen on {listen}: {e} (is the port taken?)") from None
        if port == 0:
            raise ConfigError(f"cannot listen on {listen} (is the port taken?)")
        await self._server.start()
        self.port = port
        if cfg.bulk:
            try:
                context = functools.partial(server_context, self.certificate) if self.certificate is not None else None
                await self.bulk.start(listen.host, cfg.bulk_port, context)
            except OSError as e:
                if cfg.bulk_port:
                    raise ConfigError(f"cannot open the bulk port {listen.host}:{cfg.bulk_port}: {e}") from None
                logger.warning("no bulk side channel on %s (%s): tensors travel over gRPC only", listen.host, e)
        return port

    async def stop(self, grace: float | None = None) -> None:
        grace = self.config.shutdown_grace if grace is None else grace
        streams = list(self._call_streams)
        for task in streams:  # Calls streams last as long as their callers: end them (they answer what they took)
            task.cancel()
        if streams:
            await asyncio.wait(streams, timeout=grace)
        await self.bulk.stop()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None


async def _handle(
    stats: MethodMetrics, make_context: Callable[[], CallContext], run: Callable[[CallContext], Awaitable[object]],
    limiter: CallLimiter, limit: CallLimit | None,
) -> bytes:
    """What every call answered with one response shares, over gRPC or a Calls stream: its
    context (authenticating the caller), admission, the handler, the response's bytes, and metrics."""
    started, ok = stats.start(), False  # metrics
    try:
        ctx = make_context()
        limiter.admit(limit, ctx.peer_id, ctx.source)
        try:
            data = _serialize(await run(ctx))
        finally:
            limiter.release(limit, ctx.peer_id, ctx.source)
        stats.sent.value += len(data)  # metrics
        ok = True
        return data
    finally:
        stats.finish(started, ok)  # metrics


async def _single(request: bytes, stats: MethodMetrics) -> AsyncIterator[bytes]:
    stats.received.value += len(request)  # metrics
    yield request


async def _counted(requests: AsyncIterator[bytes], stats: MethodMetrics) -> AsyncIterator[bytes]:
    """Counts received bytes of a request stream (metrics): one addition per message."""
    received = stats.received
    async for request in requests:
        received.value += len(request)
        yield request


def reachable_addrs(listen: Multiaddr, port: int, peer_id: str, announce: list[Multiaddr]) -> list[str]:
    """The multiaddrs others can dial: `--announce` if given, else the listen address, with
    0.0.0.0 / :: expanded to loopback and this host's own addresses."""
    if announce:
        return [str(a.with_port(a.port or port).with_peer_id(peer_id)) for a in announce]
    if not listen.is_unspecified:
        return [str(listen.with_port(port).with_peer_id(peer_id))]
    family, protocol, loopback = (
        (socket.AF_INET, "ip4", "127.0.0.1") if listen.protocol == "ip4" else (socket.AF_INET6, "ip6", "::1")
    )
    hosts = [loopback]
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM):
            host = str(info[4][0]).split("%")[0]
            if host not in hosts and not host.startswith("127.") and host != "::1":
                hosts.append(host)
    except OSError:
        pass
    return [str(Multiaddr(protocol, h, port, peer_id)) for h in hosts]


__all__ = ["CallContext", "CallLimit", "RPCServer", "ServerConfig", "Unauthenticated", "reachable_addrs"]
