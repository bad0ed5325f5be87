"""Simulated links and virtual time for running many swarm nodes in one process (scripts/bench/sim_*.py).

The protocol code is swarm's own; only the transport and the clock are simulated:

- `install_virtual_time()` makes `time.time` and `time.monotonic` read a virtual clock, and
  `VirtualTimeLoop` is an asyncio loop whose clock jumps to the next timer whenever nothing is
  ready, so an hour of protocol time costs only the CPU its messages need. It must be called
  before swarm is imported (some modules bind `time.time` as a default argument). Work handed to
  threads (`run_in_executor`) holds the clock still until it is done.
- `SimNetwork` holds the live nodes and the links between them: each node has an access round
  trip drawn from a clipped log-normal distribution, a link's round trip is the mean of its two
  ends' (plus 10% jitter), and every message (request or answer) is lost with probability
  `loss`: the caller then waits out its deadline, as for a lost packet.
- `SimServer` stands in for `swarm.net.server.RPCServer` (handlers register the same way) and
  `SimPool` for `swarm.net.channels.ChannelPool`: a `SimChannel.unary` serializes the request,
  delays it by half the link's round trip, runs the callee's handler in the callee's own context,
  serializes the answer and delays it back. `SimChannel.stream` does the same per message of a
  stream. A node that crashed never answers (its callers time out); one that left cleanly refuses
  connections (its callers fail after one round trip).
- Traffic is counted per `TAG` (a context variable the caller sets around the work it measures;
  handlers run in their own node's context, so the upkeep they start counts as its own).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import math
import random
import selectors
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

EPOCH = 1_800_000_000.0
"""Virtual `time.time()` at virtual second 0."""

TAG: contextvars.ContextVar[str] = contextvars.ContextVar("sim_tag", default="upkeep")
"""What the traffic sent from the current context is counted as."""

ORIGIN: contextvars.ContextVar[str] = contextvars.ContextVar("sim_origin", default="other")
"""Which of a node's activities sent the traffic of the current context (`attribute`)."""


def attribute(cls: type, name: str, origin: str) -> None:
    """Counts the traffic of every call of the coroutine method `cls.name` (and of the tasks it
    starts) as `origin`, so that a simulation can say which activity its upkeep comes from."""
    import functools

    method = getattr(cls, name)

    @functools.wraps(method)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        token = ORIGIN.set(origin)
        try:
            return await method(*args, **kwargs)
        finally:
            ORIGIN.reset(token)

    setattr(cls, name, wrapper)


class _Clock:
    now = 0.0
    threads_busy = 0


CLOCK = _Clock()


def install_virtual_time() -> None:
    """Makes `time.time()` and `time.monotonic()` read the simulation's clock (call before importing swarm)."""
    time.time = lambda: EPOCH + CLOCK.now  # type: ignore[assignment]
    time.monotonic = lambda: CLOCK.now  # type: ignore[assignment]


def share_parsing() -> None:
    """Memoizes `Multiaddr.parse` across the process (multiaddrs are immutable): every simulated
    node parses the same few thousand addresses, which on N machines costs each of them once."""
    from swarm.core.multiaddr import Multiaddr

    original = Multiaddr.parse.__func__  # type: ignore[attr-defined]
    memo: dict[str, Any] = {}

    def parse(cls: type, text: str) -> Any:
        found = memo.get(text) if isinstance(text, str) else None
        if found is None:
            found = original(cls, text)  # bad input raises, and is not remembered
            if len(memo) < 1 << 20:
                memo[text] = found
        return found

    Multiaddr.parse = classmethod(parse)  # type: ignore[method-assign, assignment]


class _VirtualSelector(selectors.DefaultSelector):
    """Never waits: when nothing is ready, the clock jumps by the loop's timeout instead."""

    def select(self, timeout: float | None = None) -> list[Any]:
        if CLOCK.threads_busy:  # a thread computes for the loop: real time passes, the clock stands
            return super().select(timeout if timeout is None else min(timeout, 0.05))
        events = super().select(0)
        if events or not timeout:
            return events
        if timeout is None:
            return super().select(None)
        CLOCK.now += timeout
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on the virtual clock (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(_VirtualSelector())
        self.set_debug(False)

    def time(self) -> float:
        return CLOCK.now

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:
        CLOCK.threads_busy += 1
        future = super().run_in_executor(executor, func, *args)

        def done(_: Any) -> None:
            CLOCK.threads_busy -= 1

        future.add_done_callback(done)
        return future


def lognormal_rtt(rng: random.Random, median: float = 0.06, sigma: float = 0.7,
                  low: float = 0.01, high: float = 0.3) -> float:
    """An access round trip in seconds: log-normal around `median`, clipped to [low, high]."""
    return min(high, max(low, rng.lognormvariate(math.log(median), sigma)))


@dataclass
class Traffic:
    """Messages and payload bytes sent, per tag (requests and answers both count)."""

    messages: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    by_method: Counter[str] = field(default_factory=Counter)
    by_tag_method: Counter[tuple[str, str]] = field(default_factory=Counter)
    by_origin: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    """Bytes per (tag, origin, method)."""
    messages_by_origin: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    lost: int = 0

    def add(self, nbytes: int, method: str = "") -> None:
        tag = TAG.get()
        self.messages[tag] += 1
        self.bytes[tag] += nbytes
        self.by_method[method] += nbytes
        self.by_tag_method[tag, method] += nbytes
        origin = ORIGIN.get()
        self.by_origin[tag, origin, method] += nbytes
        self.messages_by_origin[tag, origin, method] += 1


class SimNetwork:
    """The live nodes and their links (see the module docstring).

    Args:
        rng: Source of the links' round trips, jitter and losses.
        loss: Probability that a unary message (request or answer) is lost.
        retransmit: What a lost message costs. False: it is gone, and the caller waits out its
            deadline (pessimistic, as for a datagram). True: TCP sends it again after a
            retransmission timeout of max(0.2 s, 2 round trips), so it only arrives late.
    """

    def __init__(self, rng: random.Random, loss: float = 0.0, retransmit: bool = False) -> None:
        self.rng = rng
        self.loss = loss
        self.retransmit = retransmit
        self.servers: dict[str, SimServer] = {}
        self.gone: dict[str, str] = {}  # peer_id -> "left" or "crashed"
        self.rtt: dict[str, float] = {}  # peer_id -> access round trip
        self.traffic = Traffic()
        self._hosts = 0

    def add_host(self, peer_id: str, rtt: float | None = None) -> str:
        """Registers a node's access round trip; returns a fresh IP address for it."""
        self._hosts += 1
        self.rtt[peer_id] = lognormal_rtt(self.rng) if rtt is None else rtt
        n = self._hosts
        return f"10.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"

    def one_way(self, a: str, b: str) -> float:
        base = (self.rtt.get(a, 0.05) + self.rtt.get(b, 0.05)) / 4
        return base * self.rng.uniform(0.95, 1.05)

    def lost(self) -> bool:
        """Whether the next message is lost for good (with `retransmit`, never: see `resent_after`)."""
        if not self.retransmit and self.loss and self.rng.random() < self.loss:
            self.traffic.lost += 1
            return True
        return False

    def resent_after(self, one_way: float) -> float:
        """With `retransmit`, the extra delay of the next message: a retransmission timeout per loss."""
        delay = 0.0
        while self.retransmit and self.loss and self.rng.random() < self.loss:
            self.traffic.lost += 1
            delay += max(0.2, 4 * one_way)
        return delay

    def crash(self, peer_id: str) -> None:
        """The node stops answering anything, at once and without a word."""
        server = self.servers.pop(peer_id, None)
        self.gone[peer_id] = "crashed"
        if server is not None:
            for task in list(server.tasks):
                task.cancel()

    def left(self, peer_id: str) -> None:
        """The node's process exited: its port refuses connections."""
        self.servers.pop(peer_id, None)
        self.gone[peer_id] = "left"


class _FakeGrpcContext:
    """What handlers read of a gRPC context: the caller's address."""

    def __init__(self, host: str, deadline: float) -> None:
        self._peer = f"ipv4:{host}:40000"
        self._deadline = deadline

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - CLOCK.now)


class SimServer:
    """Stands in for `RPCServer`: handlers register by method path, calls arrive from `SimChannel`."""

    def __init__(self, net: SimNetwork, peer_id: str, host: str) -> None:
        self.net = net
        self.peer_id = peer_id
        self.host = host
        self.unary_handlers: dict[str, tuple[Any, Any, bool]] = {}
        self.stream_handlers: dict[str, Any] = {}
        self.context = contextvars.Context()  # handlers run here: their traffic counts as upkeep
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Runs a handler in this node's context; a crash cancels it."""
        task = asyncio.get_running_loop().create_task(coro, context=self.context.copy())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # `limit` (per-source admission, swarm/net/limits.py) is not simulated: every simulated peer is its own source
    def add_unary(self, path: str, handler: Any, request_type: Any = None, *, authenticated: bool = True,
                  limit: Any = None) -> None:
        self.unary_handlers[path] = (handler, request_type, authenticated)

    def add_stream(self, path: str, handler: Any, *, request_streaming: bool = True, bulk: bool = False,
                   limit: Any = None) -> None:
        self.stream_handlers[path] = handler

    def add_stream_unary(self, path: str, handler: Any, *, limit: Any = None) -> None:
        self.stream_handlers[path] = handler

    def start_serving(self) -> None:
        self.net.servers[self.peer_id] = self
        self.net.gone.pop(self.peer_id, None)


class SimPool:
    """Stands in for `ChannelPool`: one `SimChannel` per callee."""

    def __init__(self, net: SimNetwork, identity: Any, host: str) -> None:
        self.net = net
        self.identity = identity
        self.host = host
        from swarm.net.estimates import LinkEstimates

        self.estimates = LinkEstimates()  # what the real pool measures per peer (RTT, throughput)
        self._channels: dict[str, SimChannel] = {}

    def __len__(self) -> int:
        return len(self._channels)

    def get(self, addr: Any) -> SimChannel:
        peer_id = addr if isinstance(addr, str) and not addr.startswith("/") else _peer_id_of(addr)
        channel = self._channels.get(peer_id)
        if channel is None:
            channel = self._channels[peer_id] = SimChannel(self, peer_id)
        return channel

    def known(self, peer_id: str) -> SimChannel | None:
        return self._channels.get(peer_id)

    async def dial_unknown(self, addr: Any) -> SimChannel:
        from swarm.core.errors import PeerUnreachable

        raise PeerUnreachable(f"the simulation dials PeerIDs only, not {addr}")

    async def forget(self, peer_id: str) -> None:
        self._channels.pop(peer_id, None)

    async def close(self) -> None:
        self._channels.clear()


def _peer_id_of(addr: Any) -> str:
    if isinstance(addr, str):
        from swarm.core.multiaddr import Multiaddr

        addr = Multiaddr.parse(addr)
    return addr.peer_id or ""


def _encode(message: Any) -> bytes:
    if isinstance(message, bytes):
        return message
    if isinstance(message, bytearray | memoryview):
        return bytes(message)
    if isinstance(message, tuple | list):
        return b"".join(bytes(part) for part in message)
    return message.SerializeToString()


class SimChannel:
    """Stands in for `PeerChannel` (`unary` and `stream`), over the simulated link."""

    def __init__(self, pool: SimPool, peer_id: str) -> None:
        self.pool = pool
        self.net = pool.net
        self.peer_id = peer_id
        self.caller = pool.identity.peer_id

    def _callee(self, method: str) -> SimServer:
        from swarm.core.errors import DeadlineExceeded, PeerUnreachable

        server = self.net.servers.get(self.peer_id)
        if server is None:
            state = self.net.gone.get(self.peer_id, "crashed")
            if state == "left":
                raise PeerUnreachable(f"{self.peer_id} refused the connection ({method})", peer_id=self.peer_id)
            raise DeadlineExceeded(f"{self.peer_id} did not answer ({method})", peer_id=self.peer_id)
        return server

    async def verify(self) -> None:
        """`PeerChannel.verify` completes the TLS handshake; a simulated link has none."""

    async def _wait_out(self, deadline: float, method: str) -> None:
        from swarm.core.errors import DeadlineExceeded

        await asyncio.sleep(max(0.0, deadline - CLOCK.now))
        raise DeadlineExceeded(f"no answer from {self.peer_id} in time ({method})", peer_id=self.peer_id)

    async def unary(self, method: str, request: Any, response_type: Any = None, timeout: float | None = None) -> Any:
        from swarm.core.errors import DeadlineExceeded, PeerUnreachable, RemoteError
        from swarm.net.errors import from_status, to_status
        from swarm.net.server import CallContext

        deadline = CLOCK.now + (timeout or 10.0)
        payload = _encode(request)
        self.net.traffic.add(len(payload), method)
        one_way = self.net.one_way(self.caller, self.peer_id)
        try:
            server = self._callee(method)
        except PeerUnreachable:
            await asyncio.sleep(min(2 * one_way, max(0.0, deadline - CLOCK.now)))
            raise
        except DeadlineExceeded:
            await self._wait_out(deadline, method)
        if self.net.lost() or 2 * one_way >= deadline - CLOCK.now:
            await self._wait_out(deadline, method)
        await asyncio.sleep(one_way + self.net.resent_after(one_way))
        entry = server.unary_handlers.get(method)
        if entry is None:
            raise RemoteError(f"{self.peer_id} serves no {method}", peer_id=self.peer_id)
        handler, request_type, authenticated = entry
        ctx = CallContext(self.caller if authenticated else "", _FakeGrpcContext(self.pool.host, deadline), deadline)
        decoded = request_type.FromString(payload) if request_type is not None else payload
        task = server.spawn(handler(decoded, ctx))
        try:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - CLOCK.now))
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            raise DeadlineExceeded(f"{self.peer_id} answered too late ({method})", peer_id=self.peer_id)
        if task.cancelled():  # the callee crashed while answering
            await self._wait_out(deadline, method)
        error = task.exception()
        if error is not None:  # the handler's failure travels back as a status
            code = to_status(error)
            if code is None:
                raise RemoteError(f"internal error in {method}: {error}", peer_id=self.peer_id)
            raise from_status(code, str(error), self.peer_id, method)
        response = task.result()
        data = _encode(response)
        if self.peer_id not in self.net.servers:  # it died while answering
            await self._wait_out(deadline, method)
        self.net.traffic.add(len(data), method)
        if self.net.lost():
            await self._wait_out(deadline, method)
        await asyncio.sleep(min(one_way + self.net.resent_after(one_way), max(0.0, deadline - CLOCK.now)))
        if CLOCK.now >= deadline:
            raise DeadlineExceeded(f"{self.peer_id} answered too late ({method})", peer_id=self.peer_id)
        if response_type is None:
            return data
        return response_type.FromString(data)

    async def stream(
        self, method: str, requests: AsyncIterator[bytes] | Iterable[bytes], timeout: float | None = None,
        *, bulk: bool = False, sink: Any = None,
    ) -> AsyncIterator[bytes]:
        """A bidirectional stream: the callee's handler runs in a task of its own (in the callee's
        context), each message in either direction arrives the link's one-way time after it was
        sent, in order, and is counted; none is lost (a stream rides one TCP connection). A callee
        that crashes stops answering: the caller waits out its deadline."""
        from swarm.core.errors import DeadlineExceeded, RemoteError
        from swarm.net.errors import from_status, to_status
        from swarm.net.server import CallContext

        loop = asyncio.get_running_loop()
        deadline = CLOCK.now + (timeout or 60.0)
        one_way = self.net.one_way(self.caller, self.peer_id)
        try:
            server = self._callee(method)
        except DeadlineExceeded:
            await self._wait_out(deadline, method)
        handler = server.stream_handlers.get(method)
        if handler is None:
            raise RemoteError(f"{self.peer_id} serves no {method}", peer_id=self.peer_id)
        net, callee, caller = self.net, self.peer_id, self.caller
        inbound: asyncio.Queue[Any] = asyncio.Queue()  # at the callee
        outbound: asyncio.Queue[Any] = asyncio.Queue()  # at the caller
        end = object()

        in_flight: dict[int, collections.deque[Any]] = {id(inbound): collections.deque(),
                                                        id(outbound): collections.deque()}

        def send(queue: asyncio.Queue[Any], item: Any, receiver: str) -> None:
            # timers due at the same moment fire in any order: each one delivers the oldest message
            in_flight[id(queue)].append(item)
            loop.call_later(one_way, deliver, queue, receiver)

        def deliver(queue: asyncio.Queue[Any], receiver: str) -> None:
            item = in_flight[id(queue)].popleft()
            if receiver == caller or receiver in net.servers:  # a crashed host receives nothing
                queue.put_nowait(item)

        async def pump() -> None:  # the caller's side of the stream, sent as it is produced
            try:
                if isinstance(requests, AsyncIterator):
                    async for message in requests:
                        data = _encode(message)
                        net.traffic.add(len(data), method)
                        send(inbound, data, callee)
                else:
                    for message in requests:
                        data = _encode(message)
                        net.traffic.add(len(data), method)
                        send(inbound, data, callee)
            finally:
                send(inbound, end, callee)

        async def received() -> AsyncIterator[bytes]:
            while True:
                item = await inbound.get()
                if item is end:
                    return
                yield item

        async def serve() -> None:  # the callee's side
            try:
                async for response in handler(received(), CallContext(caller, None, deadline)):
                    data = _encode(response)
                    net.traffic.add(len(data), method)
                    send(outbound, data, caller)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - travels back as the stream's status
                code = to_status(e)
                error = (RemoteError(f"internal error in {method}: {e}", peer_id=callee) if code is None
                         else from_status(code, str(e), callee, method))
                send(outbound, error, caller)
                return
            send(outbound, end, caller)

        pump_task = loop.create_task(pump())
        serve_task = server.spawn(serve())
        try:
            while True:
                try:
                    item = await asyncio.wait_for(outbound.get(), max(0.0, deadline - CLOCK.now))
                except TimeoutError:
                    raise DeadlineExceeded(f"stream {method} to {callee} ran past its deadline",
                                           peer_id=callee) from None
                if item is end:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            pump_task.cancel()
            serve_task.cancel()

    async def info(self, timeout: float | None = None) -> Any:
        from swarm.core.errors import DeadlineExceeded
        from swarm.proto import peer_pb2

        deadline = CLOCK.now + (timeout or 10.0)
        try:
            self._callee("/swarm.Peer/Info")
        except DeadlineExceeded:
            await self._wait_out(deadline, "/swarm.Peer/Info")
        await asyncio.sleep(2 * self.net.one_way(self.caller, self.peer_id))
        return peer_pb2.PeerInfo(peer_id=self.peer_id)


class _LoopShim:
    """What swarm's components ask of `peer.loop`: run a coroutine on the loop they are already on."""

    async def wrap(self, coro: Any) -> Any:
        return await coro


class SimPeer:
    """What swarm's components (`DHT.create`, `Averager`) ask of a `swarm.Peer`, on a `SimNetwork`.

    Args:
        net: The network.
        identity: The peer's `swarm.core.identity.Identity`.
    """

    def __init__(self, net: SimNetwork, identity: Any) -> None:
        self.net = net
        self.identity = identity
        self.peer_id: str = identity.peer_id
        host = net.add_host(self.peer_id)
        self.addrs = [f"/ip4/{host}/tcp/31337/p2p/{self.peer_id}"]
        self.server = SimServer(net, self.peer_id, host)
        self.pool = SimPool(net, identity, host)
        self.initial_peers: list[Any] = []
        self.loop = _LoopShim()
        self.dht: Any = None
        from swarm.core.services import Services

        self.services = Services()  # the per-peer services (averaging RPCs, ...) a real peer owns
        self.components: list[Any] = []

    def attach(self, component: Any) -> None:
        self.components.append(component)

    def detach(self, component: Any) -> None:
        if component in self.components:
            self.components.remove(component)

    async def start_dht(self, config: Any, initial_addrs: list[str]) -> None:
        """Starts serving and joins the DHT through `initial_addrs`, in the node's own context (so
        its joining and its background upkeep count as upkeep). Raises `DHTError` as `DHT.create` does."""
        from swarm.core.multiaddr import Multiaddr
        from swarm.dht import DHT

        self.initial_peers = [Multiaddr.parse(a) for a in initial_addrs]
        self.server.start_serving()
        try:
            self.dht = await self.server.spawn(DHT.create(self, config))
        except BaseException:
            self.net.crash(self.peer_id)
            raise

    async def crash(self) -> None:
        """Stops answering at once, without a word; the DHT node's background work stops too."""
        self.net.crash(self.peer_id)
        if self.dht is not None:
            await self.dht.node.shutdown(leave=False)

    async def leave(self) -> None:
        """Shuts the DHT down politely (goodbyes), then the process exits."""
        if self.dht is not None:
            await self.dht.ashutdown()
        self.net.left(self.peer_id)


def run(coro: Any) -> Any:
    """Runs `coro` on a fresh `VirtualTimeLoop`, then cancels whatever it left running, and closes the loop."""
    loop = VirtualTimeLoop()
    try:
        result = loop.run_until_complete(coro)
        for _ in range(3):  # cancelling a task may start others (cleanups): a few passes
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            if not pending:
                break
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.wait(pending, timeout=60))
        return result
    finally:
        loop.close()


def rss_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")
