"""Direct connections between peers behind NAT: a hole punch coordinated through a relay
(libp2p's DCUtR idea; docs/relay.md, "Hole punching").

A caller that would reach a relayed peer through its relay first asks for a circuit to the peer's
`PUNCH_PORT` and, over it, exchanges the public address each side's NAT gives it (the relay told
each its own: the `OBSERVED` line of a reservation, or a public peer's own address) with a port
each side has just bound:

    relay:  CALLER <caller ip> <port>          (to the callee only: where the circuit came from)
    caller: PUNCH <port> <caller ip> <caller port>     (port: GRPC_PORT or the callee's bulk port)
    callee: ADDR <callee ip> <callee port>   or   NO <reason>
    caller: SYNC                              (sent once the caller measured the round trip)

The callee sends SYNs only to the address its relay saw the caller come from (`CALLER`): a
caller that names another address is refused, so a punch cannot be aimed at a third party. And
it answers at most `PunchLimits` punches per caller address, per source network and in all per
minute (each costs some 80 SYNs), refusing the others with `NO too many punches ...`.

The callee dials the caller as soon as it reads `SYNC`; the caller dials half a round trip after
sending it, so both SYNs cross the NATs at about the same time (a TCP simultaneous open), each
from its bound port, retrying for a few seconds. Behind a NAT that keeps the source port (a
port-preserving MASQUERADE, most home routers) the announced port is the one the other side sees,
and the connection gets through; behind one that picks another port per destination
(`--random-fully`, symmetric NAT) it does not, and the caller falls back to the relay.

The punched connection carries the same TLS as every other (bound to the dialed PeerID), so a
relay that lies about an address can only make the punch fail. The callee splices it to its own
server's port, exactly as it does a relayed circuit.

`DirectPaths` is the caller's side: `dial(relayed, port, timeout)` returns a socket to the peer's
port, direct when a punch works, through the relay otherwise, and remembers failures for a while
so a peer behind a symmetric NAT costs one failed punch per `retry_after`, not one per call. A
local HTTP CONNECT proxy on loopback (`proxy_for`) gives grpc the same: a relayed peer's
channel dials the proxy, which punches (or falls back) and splices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from swarm.core.errors import ConfigError, PeerUnreachable
from swarm.core.multiaddr import Multiaddr
from swarm.net import relay
from swarm.net.server import network_of
from swarm.net.sockets import listening_socket

logger = logging.getLogger(__name__)

_LINE_LIMIT = 256


@dataclass(frozen=True)
class PunchConfig:
    """Attributes:
        punch_timeout: seconds for the whole punch (coordination and the simultaneous open).
        attempt_timeout: seconds one connect attempt waits for the other side's SYN.
        retry_after: seconds a peer whose punch failed is reached through its relay only.
    """

    punch_timeout: float = 4.0
    attempt_timeout: float = 0.5
    retry_after: float = 600.0


@dataclass(frozen=True)
class PunchLimits:
    """How many hole punches a callee answers (each sends up to ~80 SYNs to the caller's address).

    Attributes:
        per_caller: punches per `window` for one caller IP address (as its relay saw it).
        per_network: for one source network (/`network_bits_v4`, /`network_bits_v6`).
        total: for all callers together.
        concurrent: punches in progress at once.
        window: seconds in which each of those counts refills (a token bucket).
    """

    per_caller: int = 8
    per_network: int = 16
    total: int = 64
    concurrent: int = 8
    window: float = 60.0
    network_bits_v4: int = 24
    network_bits_v6: int = 48

    def __post_init__(self) -> None:
        if min(self.per_caller, self.per_network, self.total, self.concurrent) < 1 or self.window <= 0:
            raise ConfigError("hole punch limits must be at least 1 (and the window positive)")


class PunchGuard:
    """The callee's account of the punches it answers (`PunchLimits`); `refused` counts why not.

    Args:
        limits: the limits.
        clock: monotonic seconds (a test's clock can stand in).
    """

    def __init__(self, limits: PunchLimits | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or PunchLimits()
        self.clock = clock
        self.active = 0
        self.admitted = 0
        self.refused: Counter[str] = Counter()
        self._buckets: dict[tuple[str, str], tuple[float, float, int]] = {}  # (kind, key) -> tokens, stamp, capacity

    def _tokens(self, kind: str, key: str, capacity: int, now: float) -> float:
        tokens, stamp, _ = self._buckets.get((kind, key), (float(capacity), now, capacity))
        return min(float(capacity), tokens + (now - stamp) * capacity / self.limits.window)

    def admit(self, ip: str) -> str:
        """Counts a punch to `ip` and returns "" if it may go ahead, else why not (for its `NO`)."""
        cfg, now = self.limits, self.clock()
        network = network_of(ip, (), cfg.network_bits_v4, cfg.network_bits_v6) or ip
        checks = (("caller", ip, cfg.per_caller, "from your address"),
                  ("network", network, cfg.per_network, "from your network"),
                  ("total", "", cfg.total, "from all callers"))
        reason = ""
        if self.active >= cfg.concurrent:
            reason = "too many punches at once"
        for kind, key, capacity, whose in checks:
            if not reason and self._tokens(kind, key, capacity, now) < 1.0:
                reason = f"too many punches {whose} ({capacity} per {cfg.window:g} s)"
        if reason:
            self.refused[reason.split(" (")[0]] += 1
            return reason
        if len(self._buckets) > 4 * cfg.total:  # forget the full ones: the table stays small
            self._buckets = {k: b for k, b in self._buckets.items() if self._tokens(*k, b[2], now) < b[2]}
        for kind, key, capacity, _ in checks:
            self._buckets[(kind, key)] = (self._tokens(kind, key, capacity, now) - 1.0, now, capacity)
        self.active += 1
        self.admitted += 1
        return ""

    def release(self) -> None:
        """A punch `admit` let through is over."""
        self.active -= 1


def _same_ip(a: str, b: str) -> bool:
    """Whether two strings name one IP address (an IPv4 address seen as IPv6 is the same one)."""
    one = network_of(a, (), 32, 128)
    return bool(one) and one == network_of(b, (), 32, 128)


def _bound(port: int, family: int = socket.AF_INET) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setblocking(False)
    sock.bind(("0.0.0.0" if family == socket.AF_INET else "::", port))
    return sock


async def simultaneous_open(local_port: int, remote: tuple[str, int], deadline: float,
                            attempt_timeout: float) -> socket.socket:
    """Connects from `local_port` to `remote` again and again until a connection holds (the other
    side does the same towards us) or `deadline` (loop time); raises OSError if none did."""
    loop = asyncio.get_running_loop()
    error: Exception = OSError("no attempt made")
    for _ in range(1000):  # bounded: each attempt takes at least a few ms
        if loop.time() >= deadline:
            break
        sock = _bound(local_port)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, remote), min(attempt_timeout, deadline - loop.time()))
            return sock
        except (OSError, TimeoutError) as e:
            sock.close()
            error = e
            await asyncio.sleep(0.05)  # the pace of retries: a refused SYN comes back at once
    raise OSError(f"simultaneous open to {remote[0]}:{remote[1]} failed: {type(error).__name__}: {error}")


async def _line(reader: asyncio.StreamReader, deadline: float) -> list[str]:
    loop = asyncio.get_running_loop()
    raw = await asyncio.wait_for(reader.readline(), max(0.01, deadline - loop.time()))
    if not raw:
        raise OSError("the other side closed the coordination")
    return raw.decode(errors="replace").split()


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, observed_ip: str,
                 local_port: Callable[[int], int | None], local_host: str, *, guard: PunchGuard,
                 config: PunchConfig | None = None) -> None:
    """The callee's side, on a circuit its relay spliced to `PUNCH_PORT`: checks the caller's
    address against the relay's `CALLER` line and the punch against `guard`, agrees on addresses,
    dials on SYNC, and splices the punched connection to its own server's port."""
    cfg = config or PunchConfig()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.punch_timeout
    holder: socket.socket | None = None
    admitted = False
    try:
        seen = await _line(reader, deadline)
        if len(seen) != 3 or seen[0] != "CALLER":
            writer.write(b"NO the relay did not say where the caller is\n")  # an older relay: no punch
            return
        request = await _line(reader, deadline)
        if len(request) != 4 or request[0] != "PUNCH" or not request[1].isdigit() or not request[3].isdigit():
            writer.write(b"NO bad request\n")
            return
        target = local_port(int(request[1]))
        if target is None:
            writer.write(b"NO not a port this peer serves\n")  # never a way into its LAN
            return
        if not _same_ip(request[2], seen[1]):  # never SYNs to a third party
            guard.refused["not the caller's address"] += 1
            writer.write(f"NO {request[2][:64]} is not the address your relay saw ({seen[1]})\n".encode())
            return
        reason = guard.admit(seen[1])
        if reason:
            writer.write(f"NO {reason}\n".encode())
            return
        admitted = True
        remote = (request[2], int(request[3]))
        holder = _bound(0)  # keeps the port ours until the punch is over
        port = holder.getsockname()[1]
        writer.write(f"ADDR {observed_ip} {port}\n".encode())
        await writer.drain()
        if (await _line(reader, deadline))[:1] != ["SYNC"]:
            return
        sock = await simultaneous_open(port, remote, deadline, cfg.attempt_timeout)
    except (OSError, TimeoutError, ValueError) as e:
        logger.debug("hole punch (callee side) failed: %s", e)
        return
    finally:
        if admitted:
            guard.release()
        if holder is not None:
            holder.close()
        writer.close()
    try:
        direct_reader, direct_writer = await asyncio.open_connection(sock=sock)
        local = await asyncio.wait_for(asyncio.open_connection(local_host, target), cfg.attempt_timeout * 4)
    except (OSError, TimeoutError) as e:
        logger.debug("punched connection not spliced: %s", e)
        sock.close()
        return
    await relay.splice(direct_reader, direct_writer, local[0], local[1])


async def punch(relayed: Multiaddr, port: int, my_ip: str, config: PunchConfig | None = None, *,
                member: str = "") -> socket.socket:
    """The caller's side: a direct, connected, non-blocking socket to `port` of the peer behind
    `relayed` (`relay.GRPC_PORT` or its bulk port); raises PeerUnreachable if the punch failed.
    `member`: in a private swarm, the caller's proof for the relay (`relay.member_header`)."""
    cfg = config or PunchConfig()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.punch_timeout
    holder: socket.socket | None = None
    writer: asyncio.StreamWriter | None = None
    try:
        circuit = await relay.open_circuit(relayed, relay.PUNCH_PORT, cfg.punch_timeout, member=member)
        reader, writer = await asyncio.open_connection(sock=circuit, limit=_LINE_LIMIT)
        holder = _bound(0)
        my_port = holder.getsockname()[1]
        sent = loop.time()
        writer.write(f"PUNCH {port} {my_ip} {my_port}\n".encode())
        await writer.drain()
        reply = await _line(reader, deadline)
        rtt = loop.time() - sent
        if len(reply) != 3 or reply[0] != "ADDR" or not reply[2].isdigit():
            raise OSError(f"the peer answered {' '.join(reply)[:80]!r}")
        writer.write(b"SYNC\n")
        await writer.drain()
        await asyncio.sleep(rtt / 2)  # the SYNC's way to the callee: both dial at about the same time
        return await simultaneous_open(my_port, (reply[1], int(reply[2])), deadline, cfg.attempt_timeout)
    except (OSError, TimeoutError, PeerUnreachable) as e:
        raise PeerUnreachable(f"hole punch to {relayed.peer_id} failed: {e}", peer_id=relayed.peer_id) from None
    finally:
        if holder is not None:
            holder.close()
        if writer is not None:
            writer.close()


class DirectPaths:
    """A caller's direct paths to relayed peers (see the module docstring).

    Args:
        my_ip: returns this peer's public IP address as others see it (None: unknown, no punching).
        config: timeouts and how long a failure is remembered.
    """

    def __init__(self, my_ip: Callable[[], str | None], config: PunchConfig | None = None) -> None:
        self.my_ip = my_ip
        self.config = config or PunchConfig()
        self.failed: dict[str, float] = {}
        """PeerID -> monotonic time of its last failed punch."""
        self.direct: dict[str, int] = {}
        """PeerID -> connections punched to it."""
        self.relayed: dict[str, int] = {}
        """PeerID -> connections that went through its relay instead."""
        self.addresses: dict[str, Multiaddr] = {}
        """PeerID -> the relayed address it was last dialed at (what the local proxy punches to)."""
        self.last_error = ""
        """Why the last punch failed (for logs and tests)."""
        self._server: asyncio.Server | None = None

    def should_punch(self, peer_id: str) -> bool:
        failed = self.failed.get(peer_id)
        return self.my_ip() is not None and (failed is None or time.monotonic() - failed >= self.config.retry_after)

    async def dial(self, relayed: Multiaddr, port: int, timeout: float, *, member: str = "") -> socket.socket:
        """A socket to `port` of the peer behind `relayed`: punched if possible, else a circuit
        (`member`: the caller's proof for a private swarm's relay, `relay.member_header`)."""
        peer_id = relayed.peer_id or ""
        my_ip = self.my_ip()
        if my_ip is not None and self.should_punch(peer_id):
            try:
                sock = await punch(relayed, port, my_ip, self.config, member=member)
                self.direct[peer_id] = self.direct.get(peer_id, 0) + 1
                return sock
            except PeerUnreachable as e:
                logger.info("%s; staying on its relay for %.0f s", e, self.config.retry_after)
                self.failed[peer_id] = time.monotonic()
                self.last_error = str(e)
        self.relayed[peer_id] = self.relayed.get(peer_id, 0) + 1
        return await relay.open_circuit(relayed, port, timeout, member=member)

    # -- the local proxy grpc dials -------------------------------------------------------------

    async def start(self) -> None:
        """Starts the loopback CONNECT proxy that relayed peers' channels dial (`proxy_for`)."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, sock=listening_socket("127.0.0.1", 0),
                                                      limit=_LINE_LIMIT * 32)

    def proxy_for(self, relayed: Multiaddr) -> str | None:
        """The `host:port` a grpc channel to `relayed` takes as its HTTP CONNECT proxy: the local
        one (it punches, or falls back to the relay); None: dial the relay itself."""
        if self._server is None or not relayed.peer_id or self.my_ip() is None:
            return None
        self.addresses[relayed.peer_id] = relayed
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            parts = head.split(b"\r\n", 1)[0].decode(errors="replace").split()
            peer_id, _, port_text = parts[1].rpartition(":") if len(parts) >= 2 else ("", "", "")
            relayed = self.addresses.get(peer_id)
            if relayed is None or not port_text.isdigit():
                writer.write(b"HTTP/1.1 404 Not Found\r\n\r\n")
                writer.close()
                return
            member = next((line.partition(b":")[2].strip().decode(errors="replace") for line in head.split(b"\r\n")
                           if line.lower().startswith(relay.MEMBER_HEADER.lower().encode() + b":")), "")
            sock = await self.dial(relayed, int(port_text), self.config.punch_timeout, member=member)
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                PeerUnreachable) as e:
            logger.debug("local proxy: %s", e)
            with contextlib.suppress(OSError):
                writer.write(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
            writer.close()
            return
        try:
            far_reader, far_writer = await asyncio.open_connection(sock=sock)
        except OSError:
            sock.close()
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await relay.splice(reader, writer, far_reader, far_writer)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
