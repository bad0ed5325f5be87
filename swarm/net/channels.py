"""Client side of the gRPC layer: one channel per remote peer, keyed by PeerID.

Every call carries a ticket proving this peer's PeerID (swarm.net.auth) and an explicit deadline.
A channel is TLS 1.3 whose only trusted root is built from the PeerID the caller dialed
(`swarm.net.tls`), so a caller never talks to an address that cannot prove that PeerID, and
nobody on the path reads or rewrites a byte. With `ChannelConfig.tls=False` (`--insecure`) the
channel is plaintext and the first use runs the `Handshake` instead, which proves the callee's
PeerID but protects nothing after it. A peer of the other kind is refused with an error that
names the flag. Failures surface as swarm's typed errors.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, overload

import grpc
from google.protobuf.message import Message

from swarm.core.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    PeerUnreachable,
    PermissionDenied,
    RPCError,
    Unauthenticated,
)
from swarm.core.identity import Identity
from swarm.core.multiaddr import Multiaddr
from swarm.metrics.rpc import MethodMetrics, RPCMetrics  # metrics
from swarm.net import bulk as bulk_channel
from swarm.net import relay
from swarm.net.auth import TicketSigner, check_handshake
from swarm.net.calls import MAX_MULTIPLEXED_REQUEST, CallStream, StreamRefused
from swarm.net.errors import from_grpc_error
from swarm.net.estimates import LinkEstimates
from swarm.net.frames import Frames
from swarm.net.membership import MEMBERSHIP, MembershipGate
from swarm.net.membership import METADATA_KEY as MEMBERSHIP_KEY
from swarm.net.tls import SERVER_NAME, trust_anchor
from swarm.net.tls import probe as tls_probe
from swarm.proto import peer_pb2

if TYPE_CHECKING:
    from swarm.core.membership import Member
    from swarm.net.holepunch import DirectPaths

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)  # a response message type

def _count_bulk_connection(how: str) -> None:
    # the family is made on the first bulk stream: a DHT-only daemon loads no prometheus_client
    from swarm.metrics import BULK_CONNECTIONS

    BULK_CONNECTIONS.labels(how=how).inc()

HANDSHAKE = "/swarm.Peer/Handshake"
INFO = "/swarm.Peer/Info"


@dataclass(frozen=True)
class ChannelConfig:
    """Client-side limits and defaults.

    Attributes:
        default_timeout: deadline, in seconds, for calls that do not pass their own.
        max_message_bytes: largest single message sent or received.
        handshake_timeout: deadline for proving the callee's identity on a new channel.
        bulk_connect_timeout: how long dialing a peer's bulk port may take before its streams
            fall back to gRPC (for `bulk_retry_after` seconds, doubling while it stays unreachable).
        bulk_retry_after: seconds after a failed dial of a peer's bulk port before its streams try
            it again: a dial lost to congestion does not send that peer's tensors over gRPC forever.
        bulk_pool: keep a bulk connection whose stream ended cleanly for the next stream to the
            same peer (`swarm.net.bulk.reuse`): no TCP or TLS handshake, and a congestion window
            already open; False dials one per stream (the behaviour before, for comparison).
        bulk_idle_timeout: seconds a kept bulk connection waits for its next stream before it is
            closed (less than the callee's `BulkListener.idle_timeout`, 60 s, so that the callee
            never closes one just as the caller reuses it).
        bulk_pool_size: the most bulk connections kept per peer.
        multiplex: send small unary calls on one Calls stream per peer (`swarm.net.calls`);
            False sends each as a gRPC unary call of its own.
        calls_idle_timeout: seconds without calls after which a Calls stream ends (the next call
            opens another).
        calls_retry_after: seconds during which calls to a peer that refused a Calls stream (it
            had too many open, say) go as unary calls of their own before a stream is tried again.
        tls: dial with TLS 1.3 and check the callee's PeerID in its certificate (docs/security.md).
            False (`--insecure`) dials plaintext: only peers that are insecure too answer.
    """

    default_timeout: float = 10.0
    max_message_bytes: int = 8 << 20
    handshake_timeout: float = 5.0
    bulk_connect_timeout: float = 1.0
    bulk_retry_after: float = 30.0
    bulk_pool: bool = True
    bulk_idle_timeout: float = 30.0
    bulk_pool_size: int = 16
    multiplex: bool = True
    calls_idle_timeout: float = 60.0
    calls_retry_after: float = 10.0
    tls: bool = True

    def __post_init__(self) -> None:
        if self.default_timeout <= 0 or self.handshake_timeout <= 0 or self.calls_idle_timeout <= 0:
            raise ConfigError("timeouts must be positive")
        if self.bulk_retry_after <= 0:
            raise ConfigError("bulk_retry_after must be positive")
        if self.bulk_idle_timeout <= 0 or self.bulk_pool_size < 0:
            raise ConfigError("bulk_idle_timeout must be positive and bulk_pool_size not negative")


class PeerChannel:
    """A channel to one peer. Use `unary`, `stream` for calls; `verify()` proves the callee's PeerID."""

    def __init__(self, pool: ChannelPool, addr: Multiaddr) -> None:
        self.pool = pool
        self.addr = addr
        self.peer_id = addr.peer_id or ""
        self._channel: grpc.aio.Channel | None = None
        self._unary: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}
        self._verified: asyncio.Future[None] | None = None
        self.bulk_reachable: bool | None = None  # None: not tried yet; False: use gRPC streams only
        self._bulk_retry_at = 0.0  # while bulk_reachable is False: loop time its port is dialled again
        self._bulk_retry_after = pool.config.bulk_retry_after
        # kept bulk connections, the most recently used last: (connection, callee's bulk port, expiry)
        # kept bulk connections: (connection, the callee's bulk port, it takes reopen frames, expiry)
        self._bulk_idle: list[tuple[bulk_channel.FrameConnection, int, bool, asyncio.TimerHandle]] = []
        self._closed = False
        self._calls: CallStream | None = None  # small unary calls, multiplexed (swarm.net.calls)
        self.calls_supported = pool.config.multiplex  # False: unary calls of their own (or an older peer)
        self._calls_refused_until = 0.0  # loop time until which calls skip the stream (it was refused)
        self._limits: dict[str, asyncio.Semaphore] = {}
        self.member: Member | None = None  # in a private swarm: the membership the callee proved

    def limit(self, name: str, size: int) -> asyncio.Semaphore:
        """The semaphore `name` of this channel, made with `size` places on first use: how an upper
        layer bounds its own calls in flight to this peer (e.g. expert streams, `swarm.moe.protocol`)."""
        semaphore = self._limits.get(name)
        if semaphore is None:
            semaphore = self._limits[name] = asyncio.Semaphore(size)
        return semaphore

    @property
    def channel(self) -> grpc.aio.Channel:
        """The grpc channel, created on first use so it binds to the peer's event loop.

        Raises:
            PeerUnreachable: the channel was closed (`ChannelPool.forget`): a call made on it would
                fail with gRPC's own `UsageError`, past the caller's handling of RPC errors."""
        if self._closed:
            raise PeerUnreachable(f"the channel to {self.addr} is closed", peer_id=self.peer_id)
        if self._channel is None:
            cfg = self.pool.config
            options: list[tuple[str, int | str]] = [
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.enable_retries", 0),
                ("grpc.keepalive_time_ms", 60_000),
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2_000),
            ]
            target = self.addr.grpc_target
            if self.addr.relay_id:  # through its relay, an HTTP CONNECT proxy for this channel (docs/relay.md)
                paths = self.pool.direct_paths  # or a local one that punches a hole first (holepunch.py)
                proxy = (paths.proxy_for(self.addr) if paths is not None else None) or target
                options.append(("grpc.http_proxy", f"http://{proxy}"))
                target = f"{self.peer_id}:{relay.GRPC_PORT}"  # what the CONNECT asks the relay for
                if self.pool.gate is not None:  # a private swarm's relay serves members only
                    options.append(("grpc.http_connect_headers", f"{relay.MEMBER_HEADER}:{self._member_header()}"))
            if cfg.tls:
                # the only root is the dialed PeerID's key: nothing else can complete the handshake
                credentials = grpc.ssl_channel_credentials(root_certificates=trust_anchor(self.peer_id))
                options.append(("grpc.ssl_target_name_override", SERVER_NAME))
                self._channel = grpc.aio.secure_channel(target, credentials, options=options)
            else:
                self._channel = grpc.aio.insecure_channel(target, options=options)
        return self._channel

    def _member_header(self) -> str:
        """In a private swarm, what proves this peer's membership to the callee's relay (else "")."""
        gate = self.pool.gate
        if gate is None or not self.addr.relay_id:
            return ""
        return relay.member_header(self.pool.identity, gate.policy.proof, self.addr.relay_id, self.peer_id)

    @property
    def encrypted(self) -> bool:
        """True when this channel's traffic is TLS (and the callee proved its PeerID in it)."""
        return self.pool.config.tls

    def _metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self.pool.signer.metadata_for(self.peer_id)

    async def verify(self) -> None:
        """Runs the handshake once per channel (concurrent callers share it). A channel closed
        (`ChannelPool.forget`) fails every later call as unreachable, where gRPC would raise its
        own `UsageError` past the caller's handling of RPC errors."""
        verified = self._verified
        if verified is not None and verified.done() and verified.exception() is None and not self._closed:
            return  # the per-call fast path: no new future, no shield
        if self._closed:
            raise PeerUnreachable(f"the channel to {self.addr} is closed", peer_id=self.peer_id)
        if self._verified is None or (self._verified.done() and self._verified.exception() is not None):
            self._verified = asyncio.ensure_future(self._handshake())
            # a caller cancelled while the handshake runs leaves it unawaited: its failure is
            # reported to the callers that wait, never as "Task exception was never retrieved"
            self._verified.add_done_callback(_retrieve)
        await asyncio.shield(self._verified)
        if self._closed:  # closed while the handshake ran
            raise PeerUnreachable(f"the channel to {self.addr} is closed", peer_id=self.peer_id)

    async def _handshake(self) -> None:
        await self._prove_identity()
        if self.pool.gate is not None:
            await self._check_membership(self.pool.gate)

    async def _check_membership(self, gate: MembershipGate) -> None:
        """A private swarm: learns the callee's membership proof (its PeerID TLS proved already) and
        refuses it without a valid one. The callee sends its proof with its acceptance of the Calls
        stream, which the channel opens now for its first calls (so this costs no round trip of its
        own); where no Calls stream is accepted (refused, disabled), a `Membership` call asks for
        it. Either carries this peer's proof, which the callee checks first."""
        timeout = self.pool.config.handshake_timeout
        if self.calls_supported:
            calls = self._calls_stream()
            try:
                metadata = await asyncio.wait_for(calls.accepted(), timeout)
            except TimeoutError:
                metadata = None
            if metadata is not None:
                proof = next((v for k, v in metadata if k == MEMBERSHIP_KEY and isinstance(v, bytes)), b"")
                try:
                    self.member = gate.check_callee(self.peer_id, proof, self.addr.host)
                    return
                except PermissionDenied:
                    calls.close()  # nothing was sent on it: nothing will be
                    self._calls = None
                    raise
            calls.close()  # refused (not a member?) or silent: the call below says why
            self._calls = None
        try:
            proof = await self._raw_unary(MEMBERSHIP, b"", None, timeout, self._metadata())
        except PermissionDenied as e:
            gate.refused["refused by the callee"] += 1
            logger.warning("private swarm: %s at %s refused this peer: %s", self.peer_id, self.addr, e)
            raise
        except NotFound:
            proof = b""  # an open swarm's peer (no Membership method): it presents nothing
        self.member = gate.check_callee(self.peer_id, proof, self.addr.host)

    def _permit(self, method: str) -> None:
        """A private swarm: refuses to call `method` on a callee that lacks the role it needs."""
        gate = self.pool.gate
        if gate is not None and self.member is not None:
            gate.require_callee(self.member, method)

    async def _prove_identity(self) -> None:
        if self.pool.config.tls:
            await self._connect_tls()
            return
        challenge = os.urandom(32)
        me = self.pool.identity.peer_id
        request = peer_pb2.HandshakeRequest(challenge=challenge, caller_peer_id=me)
        try:
            response = await self._raw_unary(
                HANDSHAKE, request, peer_pb2.HandshakeResponse, self.pool.config.handshake_timeout, metadata=()
            )
            assert isinstance(response, peer_pb2.HandshakeResponse)  # decoded as that type (or raised)
        except PeerUnreachable:
            found = await tls_probe(self.addr.host, self.addr.port or 0, self.pool.config.handshake_timeout)
            if found.speaks_tls:
                raise Unauthenticated(
                    f"{self.addr} requires TLS, and this peer runs with --insecure (plaintext): "
                    "remove --insecure here, or start that peer with --insecure too",
                    peer_id=self.peer_id or None) from None
            raise
        if not self.peer_id:  # dialed a bare address: learn who is there
            from swarm.core.identity import public_key_to_peer_id

            if len(response.public_key) != 32:
                raise Unauthenticated(f"peer at {self.addr} sent a malformed handshake")
            self.peer_id = public_key_to_peer_id(response.public_key)
        check_handshake(self.peer_id, response.public_key, response.signature, challenge, me)

    async def _connect_tls(self) -> None:
        """Waits until the channel's TLS handshake succeeded (the callee proved `peer_id`); explains
        a failure with one probe of the address: not reachable, not TLS, or not that PeerID."""
        channel = self.channel
        loop = asyncio.get_running_loop()
        timeout = self.pool.config.handshake_timeout
        deadline = loop.time() + timeout
        state = channel.get_state(try_to_connect=True)
        probed = False
        while state != grpc.ChannelConnectivity.READY:
            if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE and not probed:
                probed = True
                await self._explain_failure(max(0.05, deadline - loop.time()))
            elif state == grpc.ChannelConnectivity.SHUTDOWN:
                raise PeerUnreachable(f"channel to {self.addr} is closed", peer_id=self.peer_id)
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise TimeoutError
                await asyncio.wait_for(channel.wait_for_state_change(state), left)
            except TimeoutError:
                raise DeadlineExceeded(f"no TLS connection to {self.addr} within {timeout} s",
                                       peer_id=self.peer_id) from None
            state = channel.get_state()

    async def _explain_failure(self, timeout: float) -> None:
        """Raises the reason the channel failed to connect; returns if the address looks fine now."""
        if self.addr.relay_id:  # the relay answered the CONNECT, or not: nothing more to learn by probing
            if self.pool.gate is not None:  # but a private swarm's relay says why it refused (relay.py)
                await self._explain_circuit(self.pool.gate, timeout)
            raise PeerUnreachable(f"cannot reach {self.addr} through its relay", peer_id=self.peer_id)
        found = await tls_probe(self.addr.host, self.addr.port or 0, timeout)
        if not found.reachable:
            raise PeerUnreachable(f"cannot reach {self.addr}: {found.error}", peer_id=self.peer_id)
        if not found.speaks_tls:
            raise Unauthenticated(
                f"{self.addr} does not speak TLS ({found.error}): the peer there runs with --insecure "
                "(plaintext), or is no swarm peer. Peers talk only if both run with --insecure or neither does",
                peer_id=self.peer_id)
        if found.peer_id != self.peer_id:
            raise Unauthenticated(
                f"peer at {self.addr} is not {self.peer_id}: its TLS certificate proves "
                f"{found.peer_id or 'no libp2p identity'}{f' ({found.error})' if found.error else ''}",
                peer_id=self.peer_id)

    async def _explain_circuit(self, gate: MembershipGate, timeout: float) -> None:
        """Raises `PermissionDenied` with the reason if the callee's relay refuses this peer a circuit."""
        try:
            sock = await relay.open_circuit(self.addr, relay.GRPC_PORT, timeout, member=self._member_header())
        except relay.CircuitRefused as e:
            gate.refused["refused by the relay"] += 1
            logger.warning("private swarm: %s", e)
            raise PermissionDenied(str(e), peer_id=self.peer_id) from None
        except PeerUnreachable:
            return
        sock.close()

    @overload
    async def unary(self, method: str, request: Message | bytes, response_type: type[M],
                    timeout: float | None = None) -> M: ...

    @overload
    async def unary(self, method: str, request: Message | bytes, response_type: None = None,
                    timeout: float | None = None) -> bytes: ...

    async def unary(
        self, method: str, request: Message | bytes, response_type: type[M] | None = None,
        timeout: float | None = None,
    ) -> M | bytes:
        """One request, one response; raises swarm's `RPCError` subclasses on failure.

        Small requests travel on the channel's Calls stream (`swarm.net.calls`), others as gRPC
        unary calls of their own; both reach the same handler and fail with the same errors.
        """
        await self.verify()
        if self.member is not None:
            self._permit(method)
        payload = request if isinstance(request, bytes) else request.SerializeToString()
        if (self.calls_supported and len(payload) <= MAX_MULTIPLEXED_REQUEST
                and (not self._calls_refused_until or asyncio.get_running_loop().time() >= self._calls_refused_until)):
            try:
                return await self._multiplexed(method, payload, response_type, timeout)
            except StreamRefused as e:  # the request reached no handler: send it on its own
                if e.unsupported:
                    logger.debug("%s has no Calls stream: unary calls of their own", self.peer_id)
                    self.calls_supported = False
                else:
                    logger.debug("%s refused a Calls stream (%s): unary calls for a while", self.peer_id, e)
                    self._calls_refused_until = asyncio.get_running_loop().time() + self.pool.config.calls_retry_after
        return await self._raw_unary(method, payload, response_type, timeout, self._metadata())

    async def _multiplexed(
        self, method: str, payload: bytes, response_type: type[M] | None, timeout: float | None,
    ) -> M | bytes:
        calls = self._calls_stream()
        stats = self.pool.metrics.method(method)  # metrics
        started, ok = stats.start(), False  # metrics
        stats.sent.value += len(payload)  # metrics
        try:
            data = await calls.call(method, payload, timeout or self.pool.config.default_timeout)
            stats.received.value += len(data)  # metrics
            ok = True
            self.pool.estimates.observe_call(self.peer_id, method, time.perf_counter() - started)  # the link's RTT estimate
        finally:
            stats.finish(started, ok)  # metrics
        return self._decode(data, response_type)

    def _calls_stream(self) -> CallStream:
        """The channel's Calls stream, opened if there is none (or it ended)."""
        calls = self._calls
        if calls is None or calls.broken:
            calls = self._calls = CallStream(self.channel, self._metadata(), self.peer_id,
                                             self.pool.config.calls_idle_timeout)
        return calls

    async def _raw_unary(
        self, method: str, request: Message | bytes, response_type: type[M] | None,
        timeout: float | None, metadata: tuple[tuple[str, bytes], ...],
    ) -> M | bytes:
        callable_ = self._unary.get(method)
        if self._closed:  # closed since `verify` (a Calls stream it ended sent this call here)
            raise PeerUnreachable(f"the channel to {self.addr} was closed before {method}", peer_id=self.peer_id)
        if callable_ is None:
            callable_ = self._unary[method] = self.channel.unary_unary(method)
        payload = request if isinstance(request, bytes) else request.SerializeToString()
        stats = self.pool.metrics.method(method)  # metrics
        started, ok = stats.start(), False  # metrics
        stats.sent.value += len(payload)  # metrics
        try:
            data = await callable_(payload, timeout=timeout or self.pool.config.default_timeout, metadata=metadata)
            stats.received.value += len(data)  # metrics
            ok = True
            self.pool.estimates.observe_call(self.peer_id, method, time.perf_counter() - started)  # the link's RTT estimate
        except grpc.aio.AioRpcError as e:
            raise from_grpc_error(e, self.peer_id or str(self.addr), method) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this task is being cancelled
            # grpc.aio cancels the calls of a channel that is closed under them (`ChannelPool.forget`):
            # for the caller that is a peer it can no longer reach, not a cancellation of its own task
            raise PeerUnreachable(f"the channel to {self.addr} was closed during {method}",
                                  peer_id=self.peer_id) from None
        finally:
            stats.finish(started, ok)  # metrics
        return self._decode(data, response_type)

    def _decode(self, data: bytes, response_type: type[M] | None) -> M | bytes:
        if response_type is None:
            return data
        try:
            return response_type.FromString(data)
        except Exception as e:  # noqa: BLE001 - a lying peer
            raise InvalidRequest(f"malformed {response_type.__name__} from {self.peer_id}: {e}",
                                 peer_id=self.peer_id) from None

    async def stream(
        self, method: str, requests: AsyncIterator[Frames] | Iterable[Frames], timeout: float | None = None,
        *, bulk: bool = False, sink: bulk_channel.Sink | None = None,
    ) -> AsyncGenerator[bytes | memoryview, None]:
        """Bidirectional stream of raw-bytes messages; yields responses; errors become `RPCError`.

        With `bulk=True` the stream runs over the callee's bulk side channel (`swarm.net.bulk`) when
        it has one for `method` and its port can be reached, else over gRPC, with the same results;
        there, `sink` may receive response payloads straight into the caller's buffers (a message
        so received arrives as a `swarm.net.bulk.Sunk`).
        """
        await self.verify()
        if self.member is not None:
            self._permit(method)
        timeout = timeout or self.pool.config.default_timeout
        if bulk and (self.bulk_reachable is not False or asyncio.get_running_loop().time() >= self._bulk_retry_at):
            connection = await self._open_bulk(method, timeout)
            if connection is not None:
                stats = self.pool.metrics.method(method)  # metrics
                started, ok = stats.start(), False  # metrics
                sent, received = stats.sent, stats.received

                def count_sent(n: int) -> None:
                    sent.value += n

                def count_received(n: int) -> None:
                    received.value += n

                conn, deadline, port, reopens = connection
                if sink is not None:
                    sink.attach(conn)
                try:
                    async for response in bulk_channel.exchange(
                        conn, requests, deadline, self.peer_id, method, count_sent, count_received,
                        release=lambda c: self._keep_bulk(c, port, reopens),
                    ):
                        yield response
                    ok = True
                finally:
                    stats.finish(started, ok)  # metrics
                return
        stats = self.pool.metrics.method(method)  # metrics
        started, ok = stats.start(), False  # metrics
        call = self.channel.stream_stream(method)(
            _counted(requests, stats), timeout=timeout or self.pool.config.default_timeout, metadata=self._metadata()
        )
        received = stats.received  # metrics
        try:
            async for response in call:
                received.value += len(response)  # metrics
                yield response
            ok = True
        except grpc.aio.AioRpcError as e:
            raise from_grpc_error(e, self.peer_id, method) from None
        finally:
            call.cancel()
            stats.finish(started, ok)  # metrics

    async def _open_bulk(self, method: str, timeout: float) -> tuple[bulk_channel.FrameConnection, float, int, bool] | None:
        """A connection for one bulk stream (a kept one if any is still open, else a new one), its
        deadline, the callee's bulk port and whether the callee takes reopen frames on it; None to
        use gRPC (no side channel, or unreachable). A kept connection whose callee takes reopen
        frames starts the stream with one, with no OpenBulk call (`bulk_channel.reopen`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for entry in [e for e in reversed(self._bulk_idle) if e[2]]:
            self._bulk_idle.remove(entry)
            kept, port, _, expiry = entry
            expiry.cancel()
            if bulk_channel.reopen(kept, method, timeout):
                _count_bulk_connection("reused")
                return kept, deadline, port, True
            logger.debug("kept bulk connection to %s not usable (closed, or unasked data)", self.peer_id)
        try:
            opened = await self.unary(bulk_channel.OPEN_BULK, peer_pb2.BulkOpenRequest(method=method, timeout=timeout),
                                      peer_pb2.BulkOpenResponse, timeout=min(timeout, self.pool.config.handshake_timeout))
        except NotFound:
            self.bulk_reachable, self._bulk_retry_at = False, math.inf  # an older peer, or no bulk port there
            return None
        if not opened.port or len(opened.token) != bulk_channel.TOKEN_BYTES:
            self.bulk_reachable, self._bulk_retry_at = False, math.inf
            return None
        while self._bulk_idle:
            kept, port, _, expiry = self._bulk_idle.pop()
            expiry.cancel()
            if port == opened.port and bulk_channel.reuse(kept, opened.token):
                _count_bulk_connection("reused")
                return kept, deadline, port, opened.reopen
            logger.debug("kept bulk connection to %s not usable (closed, or unasked data): dialing", self.peer_id)
            kept.abort()  # closed meanwhile, or the callee restarted on another port: dial afresh
        logger.debug("bulk stream %s to %s: dialing a new connection", method, self.peer_id)
        connect_timeout = min(self.pool.config.bulk_connect_timeout, max(0.01, deadline - loop.time()))
        try:
            conn = await bulk_channel.connect(self.addr.host, opened.port, opened.token, connect_timeout,
                                              self.pool.config.max_message_bytes, self.peer_id,
                                              tls=self.pool.config.tls, dial=self._bulk_dial(opened.port),
                                              handshake_timeout=max(0.01, min(self.pool.config.handshake_timeout,
                                                                              deadline - loop.time())))
        except PeerUnreachable as e:
            logger.info("bulk port of %s unreachable (%s): its streams use gRPC for %.0f s", self.peer_id, e,
                        self._bulk_retry_after)
            self.bulk_reachable, self._bulk_retry_at = False, loop.time() + self._bulk_retry_after
            self._bulk_retry_after = min(2 * self._bulk_retry_after, 3600.0)
            return None
        self.bulk_reachable, self._bulk_retry_after = True, self.pool.config.bulk_retry_after
        _count_bulk_connection("dialed")
        return conn, deadline, opened.port, opened.reopen

    def _keep_bulk(self, conn: bulk_channel.FrameConnection, port: int, reopens: bool) -> None:
        """Keeps a bulk connection whose stream ended cleanly for the next stream to this peer."""
        cfg = self.pool.config
        if self._closed or not cfg.bulk_pool or len(self._bulk_idle) >= cfg.bulk_pool_size:
            conn.abort()
            return
        expiry = asyncio.get_running_loop().call_later(cfg.bulk_idle_timeout, self._expire_bulk, conn)
        self._bulk_idle.append((conn, port, reopens, expiry))

    def _expire_bulk(self, conn: bulk_channel.FrameConnection) -> None:
        self._bulk_idle = [entry for entry in self._bulk_idle if entry[0] is not conn]
        conn.close()

    def _bulk_dial(self, port: int) -> Callable[[float], Awaitable[socket.socket]] | None:
        """How a relayed peer's bulk port is dialed: a circuit through its relay (docs/relay.md)."""
        if not self.addr.relay_id:
            return None
        addr, paths, member = self.addr, self.pool.direct_paths, self._member_header()
        if paths is not None and paths.should_punch(self.peer_id):
            return lambda timeout: paths.dial(addr, port, timeout, member=member)  # direct if a punch works
        return lambda timeout: relay.open_circuit(addr, port, timeout, member=member)

    async def stream_unary(
        self, method: str, requests: AsyncIterator[Frames] | Iterable[Frames], timeout: float | None = None
    ) -> bytes:
        """Client-streaming call: many requests, one raw-bytes response."""
        await self.verify()
        if self.member is not None:
            self._permit(method)
        stats = self.pool.metrics.method(method)  # metrics
        started, ok = stats.start(), False  # metrics
        try:
            data = await self.channel.stream_unary(method)(
                _counted(requests, stats), timeout=timeout or self.pool.config.default_timeout,
                metadata=self._metadata(),
            )
            stats.received.value += len(data)  # metrics
            ok = True
            return data
        except grpc.aio.AioRpcError as e:
            raise from_grpc_error(e, self.peer_id, method) from None
        finally:
            stats.finish(started, ok)  # metrics

    async def info(self, timeout: float | None = None) -> peer_pb2.PeerInfo:
        return await self.unary(INFO, peer_pb2.InfoRequest(), peer_pb2.PeerInfo, timeout)

    async def close(self) -> None:
        self._closed = True
        for conn, _, _, expiry in self._bulk_idle:
            expiry.cancel()
            conn.close()
        self._bulk_idle = []
        if self._calls is not None:
            self._calls.close()
            self._calls = None
        if self._channel is not None:
            await self._channel.close()


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


class ChannelPool:
    """Channels to other peers, one per PeerID (re-dialed when the peer's address changes)."""

    def __init__(self, identity: Identity, config: ChannelConfig | None = None, *,
                 gate: MembershipGate | None = None) -> None:
        self.identity = identity
        self.config = config or ChannelConfig()
        self.gate = gate
        """A private swarm's gate (`swarm.net.membership`): callees must prove membership, and every
        call carries this peer's proof. None: an open swarm."""
        self.signer = TicketSigner(identity, gate.metadata if gate is not None else ())
        self._channels: dict[str, PeerChannel] = {}
        self.metrics = RPCMetrics("client")  # metrics
        self.estimates = LinkEstimates()  # measured RTT and throughput per peer
        self.direct_paths: DirectPaths | None = None  # hole punching to relayed peers, set by `NatTraversal`

    def __len__(self) -> int:
        """Channels open to other peers (for metrics: the known peers when there is no DHT)."""
        return len(self._channels)

    def get(self, addr: Multiaddr | str) -> PeerChannel:
        """Channel to the peer at `addr` (a multiaddr ending in /p2p/<PeerID>)."""
        if isinstance(addr, str):
            addr = Multiaddr.parse(addr)
        if not addr.peer_id:
            raise ConfigError(f"{addr} does not name a peer: append /p2p/<PeerID> (or use dial_unknown)")
        channel = self._channels.get(addr.peer_id)
        if channel is None or (channel.addr.grpc_target, channel.addr.relay_id) != (addr.grpc_target, addr.relay_id):
            if channel is not None:
                asyncio.ensure_future(channel.close())
            channel = self._channels[addr.peer_id] = PeerChannel(self, addr)
        return channel

    def known(self, peer_id: str) -> PeerChannel | None:
        return self._channels.get(peer_id)

    async def dial_unknown(self, addr: Multiaddr | str) -> PeerChannel:
        """Dials an address without a PeerID, learns the PeerID through the handshake."""
        if isinstance(addr, str):
            addr = Multiaddr.parse(addr)
        if addr.peer_id:
            channel = self.get(addr)
            await channel.verify()
            return channel
        if self.config.tls:  # learn the PeerID from the certificate; the channel then checks it
            found = await tls_probe(addr.host, addr.port or 0, self.config.handshake_timeout)
            if not found.reachable:
                raise PeerUnreachable(f"cannot reach {addr}: {found.error}")
            if not found.speaks_tls:
                raise Unauthenticated(
                    f"{addr} does not speak TLS ({found.error}): the peer there runs with --insecure "
                    "(plaintext), or is no swarm peer. Peers talk only if both run with --insecure or neither does")
            if found.peer_id is None:
                raise Unauthenticated(f"the peer at {addr} proves no PeerID: {found.error}")
            return await self.dial_unknown(addr.with_peer_id(found.peer_id))
        channel = PeerChannel(self, addr)
        try:
            await channel.verify()
        except RPCError:
            await channel.close()
            raise
        existing = self._channels.get(channel.peer_id)
        if existing is not None:
            await channel.close()
            return existing
        channel.addr = addr.with_peer_id(channel.peer_id)
        self._channels[channel.peer_id] = channel
        return channel

    async def forget(self, peer_id: str, channel: PeerChannel | None = None) -> None:
        """Closes the channel to `peer_id`; given `channel`, only if that one is still the peer's
        (a caller whose call failed on it must not close a newer channel that others now use)."""
        current = self._channels.get(peer_id)
        if current is None or (channel is not None and current is not channel):
            return
        del self._channels[peer_id]
        await current.close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)


def _counted(
    requests: AsyncIterator[Frames] | Iterable[Frames], stats: MethodMetrics
) -> AsyncIterator[bytes] | Iterable[bytes]:
    """Counts sent bytes of a request stream (metrics): one addition per message."""
    sent = stats.sent
    # gRPC sends bytes: a message given as a tuple of buffers (`Codec.encode_views`) is joined here
    if isinstance(requests, AsyncIterable):
        async def count_async() -> AsyncIterator[bytes]:
            async for request in requests:
                if not isinstance(request, bytes):
                    request = b"".join(request) if isinstance(request, tuple | list) else bytes(request)
                sent.value += len(request)
                yield request

        return count_async()

    def count_sync() -> Iterable[bytes]:
        for request in requests:
            if not isinstance(request, bytes):
                request = b"".join(request) if isinstance(request, tuple | list) else bytes(request)
            sent.value += len(request)
            yield request

    return count_sync()
