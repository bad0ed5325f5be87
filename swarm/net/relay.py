"""Circuit relays: how a peer behind NAT serves (docs/relay.md).

A publicly reachable peer runs a `Relay`: one TCP port that speaks three short line protocols.

- `RESERVE`: a peer behind NAT proves its PeerID (it signs the relay's nonce) and keeps this
  connection open as its reservation; the relay answers `OK <ttl>` or `NO <reason>`, and later
  writes `CIRCUIT <id> <port>` on it when someone wants to reach that peer. The peer sends `PING`
  at least every ttl/3 seconds (the relay answers `PONG`), so both sides notice a dead other.
- `CONNECT <PeerID>:<port> HTTP/1.1`: a caller asks for a circuit to a reserved peer, as an HTTP
  CONNECT proxy request (grpc dials it itself with the channel option `grpc.http_proxy`). Port
  `GRPC_PORT` means the peer's gRPC port, any other its bulk port.
- `ACCEPT <id>`: the reserved peer answers a `CIRCUIT` with a fresh outbound connection
  (connection reversal); the relay answers the caller `200` and from then on splices the two
  connections' bytes. TLS runs end to end inside them: the relay sees ciphertext only, and the
  caller still checks the callee's certificate against the PeerID it dialed.

In a private swarm the relay serves members only: a reservation carries the reserving peer's
membership proof after its signature, and a CONNECT carries a `Swarm-Member` header
(`member_header`: the caller's PeerID, its signature of the relay's and the callee's PeerIDs, its
proof). A caller without a valid one gets `403` before the reserved peer hears of it, so a
stranger costs a member nothing; refusals count toward the gate's limit per address. The header
is fixed for a channel's life (grpc sends it again on every reconnection), so it is not fresh:
someone who reads a member's CONNECT on the wire can replay it, to the same callee through the
same relay only, and that callee still refuses them after one handshake (docs/security.md).

`Reservations` is the NAT'd peer's side: it keeps reservations on a few relays, splices each
circuit to its own local server, and reports its relayed addresses when they change.
`open_circuit` is the caller's side for raw connections (the bulk side channel).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from swarm.core.errors import ConfigError, PeerUnreachable, PermissionDenied
from swarm.core.identity import Identity, verify
from swarm.core.membership import MISSING
from swarm.core.multiaddr import Multiaddr
from swarm.net.membership import MembershipGate
from swarm.net.sockets import listening_socket

logger = logging.getLogger(__name__)

GRPC_PORT = 1  # the port a CONNECT names to reach the callee's gRPC server (its real port is its own)
PUNCH_PORT = 2  # the port a CONNECT names to coordinate a hole punch with the callee (`holepunch.py`)
_RESERVE_CONTEXT = b"swarm-relay-reserve-v1"
_CIRCUIT_CONTEXT = b"swarm-relay-circuit-v1"
MEMBER_HEADER = "Swarm-Member"
"""The CONNECT header by which a caller proves membership to a private swarm's relay."""
UNPROVEN = "unproven PeerID"
_LINE_LIMIT = 1024
_HEAD_LIMIT = 8192
_CHUNK = 256 * 1024


@dataclass(frozen=True)
class RelayConfig:
    """A relay's limits (docs/relay.md: why these defaults).

    Attributes:
        max_reservations: reserved peers at once.
        max_reservations_per_ip: reserved peers at once from one IP address.
        max_circuits: spliced connections at once.
        max_circuits_per_peer: spliced connections at once to one reserved peer.
        max_circuits_per_ip: spliced connections at once from one caller IP address.
        max_pending_per_ip: connections from one IP that have not said what they want yet.
        max_bytes_per_s: the bandwidth share: bytes per second all circuits together may carry
            (each direction counted); None: unlimited.
        reservation_ttl: a reservation that sent no PING for this long is dropped.
        handshake_timeout: seconds a new connection has to send its request line and headers.
        accept_timeout: seconds the reserved peer has to answer a CIRCUIT.
    """

    max_reservations: int = 128
    max_reservations_per_ip: int = 4
    max_circuits: int = 512
    max_circuits_per_peer: int = 64
    max_circuits_per_ip: int = 64
    max_pending_per_ip: int = 16
    max_bytes_per_s: float | None = 50e6
    reservation_ttl: float = 30.0
    handshake_timeout: float = 5.0
    accept_timeout: float = 5.0

    def __post_init__(self) -> None:
        counts = (self.max_reservations, self.max_reservations_per_ip, self.max_circuits,
                  self.max_circuits_per_peer, self.max_circuits_per_ip, self.max_pending_per_ip)
        if min(counts) < 1:
            raise ConfigError("relay limits must be at least 1")
        if self.max_bytes_per_s is not None and self.max_bytes_per_s <= 0:
            raise ConfigError("relay max_bytes_per_s must be positive (or None for unlimited)")
        if min(self.reservation_ttl, self.handshake_timeout, self.accept_timeout) <= 0:
            raise ConfigError("relay timeouts must be positive")


class CircuitRefused(PeerUnreachable):
    """A private swarm's relay refused to open a circuit for this peer (`403`); `reason` is why."""

    def __init__(self, message: str, reason: str, *, peer_id: str | None = None) -> None:
        super().__init__(message, peer_id=peer_id)
        self.reason = reason


def reserve_payload(nonce: bytes, relay_id: str) -> bytes:
    """What a reserving peer signs: the relay's nonce, bound to the relay's PeerID."""
    return _RESERVE_CONTEXT + nonce + relay_id.encode()


def circuit_payload(relay_id: str, target: str) -> bytes:
    """What a private swarm's caller signs to ask the relay `relay_id` for circuits to `target`."""
    return _CIRCUIT_CONTEXT + relay_id.encode() + b"\x00" + target.encode()


def member_header(identity: Identity, proof: bytes, relay_id: str, target: str) -> str:
    """The `MEMBER_HEADER` value of a CONNECT through `relay_id` to `target`: the caller's PeerID,
    its signature of `circuit_payload`, and its membership proof (hex)."""
    signature = identity.sign(circuit_payload(relay_id, target))
    return f"{identity.peer_id} {signature.hex()} {proof.hex()}"


class TokenBucket:
    """The relay's bandwidth share: `take(n)` waits until n more bytes fit in the rate."""

    def __init__(self, rate: float | None, burst_s: float = 0.05) -> None:
        self.rate = rate
        self.capacity = max(_CHUNK, rate * burst_s) if rate else 0.0
        self.tokens = self.capacity
        self.stamp = time.monotonic()

    def debit(self, n: int, now: float) -> float:
        """Takes n bytes at time `now`; returns the seconds to wait before sending them."""
        if not self.rate:
            return 0.0
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        return -self.tokens / self.rate if self.tokens < 0 else 0.0

    async def take(self, n: int) -> None:
        wait = self.debit(n, time.monotonic())
        if wait:
            await asyncio.sleep(wait)  # pacing: the debt's worth of time


async def splice(a_reader: asyncio.StreamReader, a_writer: asyncio.StreamWriter, b_reader: asyncio.StreamReader,
                 b_writer: asyncio.StreamWriter, bucket: TokenBucket | None = None,
                 count: Callable[[int], None] | None = None) -> int:
    """Copies bytes both ways until either side closes; returns the bytes carried (`count` hears
    of them as they pass)."""
    carried = 0

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal carried
        try:
            while data := await reader.read(_CHUNK):
                if bucket is not None:
                    await bucket.take(len(data))
                writer.write(data)
                carried += len(data)
                if count is not None:
                    count(len(data))
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                if writer.can_write_eof():
                    writer.write_eof()

    tasks = [asyncio.ensure_future(pump(a_reader, b_writer)), asyncio.ensure_future(pump(b_reader, a_writer))]
    try:
        # one side ending its half is normal (a half-close); a reset or the end of both ends the circuit
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        for writer in (a_writer, b_writer):
            writer.close()
    return carried


@dataclass
class _Reservation:
    peer_id: str
    ip: str
    writer: asyncio.StreamWriter
    circuits: int = 0


class Relay:
    """The relay service of a public peer (see the module docstring).

    Args:
        identity: the relay's identity (reservations are signed for its PeerID).
        config: its limits.
        gate: in a private swarm, reservations only for members (their proof follows the signature).
    """

    def __init__(self, identity: Identity, config: RelayConfig | None = None, *,
                 gate: MembershipGate | None = None) -> None:
        self.identity = identity
        self.gate = gate
        self.config = config or RelayConfig()
        self.port: int | None = None
        self.reservations: dict[str, _Reservation] = {}
        self.bucket = TokenBucket(self.config.max_bytes_per_s)
        self.circuits = 0
        self.refused: Counter[str] = Counter()  # why requests were refused, for status and tests
        self.spliced_bytes = 0
        self._server: asyncio.Server | None = None
        self._pending: Counter[str] = Counter()
        self._circuits_by_ip: Counter[str] = Counter()
        self._waiting: dict[str, asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int = 0) -> int:
        """Listens on `host:port` (0: any free port); returns the port."""
        sock = listening_socket(host, port)
        self._server = await (asyncio.start_server(self._on_connection, sock=sock, limit=_HEAD_LIMIT)
                              if sock is not None else
                              asyncio.start_server(self._on_connection, host, port, limit=_HEAD_LIMIT))
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for reservation in list(self.reservations.values()):
            reservation.writer.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    def _count(self, n: int) -> None:
        self.spliced_bytes += n

    def _refuse(self, reason: str) -> None:
        self.refused[reason] += 1

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peer = writer.get_extra_info("peername")
        ip = str(peer[0]) if peer else "?"
        handed_over = False
        try:
            if self._pending[ip] >= self.config.max_pending_per_ip:
                self._refuse("pending")
                return
            self._pending[ip] += 1
            try:
                line = await asyncio.wait_for(reader.readline(), self.config.handshake_timeout)
            finally:
                self._pending[ip] -= 1
                if not self._pending[ip]:
                    del self._pending[ip]
            if line.startswith(b"CONNECT "):
                await self._circuit(line, reader, writer, ip)
            elif line == b"RESERVE\n":
                await self._reserve(reader, writer, ip)
            elif line.startswith(b"ACCEPT "):
                waiting = self._waiting.pop(line[7:].strip().decode(errors="replace"), None)
                if waiting is not None and not waiting.done():
                    waiting.set_result((reader, writer))
                    handed_over = True  # the circuit's task splices it and closes it
                else:
                    self._refuse("unknown circuit")
            else:
                self._refuse("bad request")
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._tasks.discard(task)
            if not handed_over:
                writer.close()

    # -- reservations ---------------------------------------------------------------------------

    async def _reserve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ip: str) -> None:
        cfg = self.config
        nonce = os.urandom(16)
        writer.write(b"NONCE " + nonce.hex().encode() + b"\n")
        answer = await asyncio.wait_for(reader.readline(), cfg.handshake_timeout)
        peer_id, _, rest = answer.decode(errors="replace").strip().partition(" ")
        signature, _, proof = rest.partition(" ")  # a member's proof follows in a private swarm
        try:
            valid = verify(peer_id, reserve_payload(nonce, self.identity.peer_id), bytes.fromhex(signature))
            membership = bytes.fromhex(proof)
        except ValueError:
            valid = False
        if not valid:
            self._refuse("bad signature")
            if self.gate is not None:  # counts toward the address's limit like any refused proof
                self.gate.refuse(peer_id, ip, "relay client", UNPROVEN, "its RESERVE signature does not verify")
            writer.write(b"NO bad signature\n")
            return
        if self.gate is not None:
            try:
                self.gate.check_proof(peer_id, membership, ip, "relay client")
            except PermissionDenied as e:
                self._refuse("not a member")
                writer.write(f"NO {e}\n".encode())
                return
        old = self.reservations.get(peer_id)
        per_ip = sum(1 for r in self.reservations.values() if r.ip == ip and r is not old)
        if old is None and len(self.reservations) >= cfg.max_reservations:
            self._refuse("reservations")
            writer.write(b"NO too many reservations\n")
            return
        if per_ip >= cfg.max_reservations_per_ip:
            self._refuse("reservations per ip")
            writer.write(b"NO too many reservations from your address\n")
            return
        if old is not None:
            old.writer.close()  # the same peer again (it reconnected): the newer one holds
        reservation = self.reservations[peer_id] = _Reservation(peer_id, ip, writer)
        writer.write(f"OK {cfg.reservation_ttl:g}\n".encode())
        peername = writer.get_extra_info("peername")
        if isinstance(peername, tuple) and len(peername) >= 2:
            # the address the peer's NAT gave it, for a hole punch (docs/relay.md); older peers ignore the line
            writer.write(f"OBSERVED {peername[0]} {peername[1]}\n".encode())
        logger.info("relay: reservation for %s from %s", peer_id, ip)
        try:
            while True:
                line = await asyncio.wait_for(reader.readline(), cfg.reservation_ttl)
                if not line:
                    return
                if line == b"PING\n":
                    writer.write(b"PONG\n")
                    await writer.drain()
        finally:
            if self.reservations.get(peer_id) is reservation:
                del self.reservations[peer_id]
                logger.info("relay: reservation of %s ended", peer_id)

    # -- circuits -------------------------------------------------------------------------------

    def _refuse_stranger(self, gate: MembershipGate, header: str, target: str, ip: str) -> str | None:
        """Why a CONNECT's caller is refused in a private swarm (None: a member); see the module docstring."""
        caller, _, rest = header.strip().partition(" ")
        signature, _, proof = rest.partition(" ")
        try:
            signed = bool(caller) and verify(caller, circuit_payload(self.identity.peer_id, target),
                                             bytes.fromhex(signature))
            membership = bytes.fromhex(proof)
        except ValueError:
            signed, membership = False, b""
        try:
            if not header:
                raise gate.refuse("", ip, "circuit caller", MISSING, f"no {MEMBER_HEADER} header in its CONNECT")
            if not signed:
                raise gate.refuse(caller, ip, "circuit caller", UNPROVEN,
                                  f"its {MEMBER_HEADER} header is not signed by {caller[:60]!r} for this relay "
                                  "and callee")
            gate.check_proof(caller, membership, ip, "circuit caller")
        except PermissionDenied as e:
            self._refuse("not a member")
            return str(e)
        return None

    async def _circuit(self, line: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ip: str) -> None:
        cfg = self.config
        headers = await asyncio.wait_for(_read_headers(reader), cfg.handshake_timeout)
        parts = line.decode(errors="replace").split()
        target, _, port_text = parts[1].rpartition(":") if len(parts) >= 2 else ("", "", "")
        if self.gate is not None:  # before anything else: a stranger learns nothing, not even who is reserved
            why = self._refuse_stranger(self.gate, headers.get(MEMBER_HEADER.lower(), ""), target, ip)
            if why is not None:
                reason = why.replace("\r", " ").replace("\n", " ")[:200]
                writer.write(f"HTTP/1.1 403 Forbidden\r\nX-Swarm-Relay: {reason}\r\n\r\n".encode())
                return
        reservation = self.reservations.get(target)
        if reservation is None or not port_text.isdigit():
            self._refuse("no reservation")
            writer.write(b"HTTP/1.1 404 Not Found\r\n\r\n")
            return
        if self.circuits >= cfg.max_circuits:
            reason = "circuits"
        elif reservation.circuits >= cfg.max_circuits_per_peer:
            reason = "circuits per peer"
        elif self._circuits_by_ip[ip] >= cfg.max_circuits_per_ip:
            reason = "circuits per ip"
        else:
            reason = ""
        if reason:
            self._refuse(reason)
            writer.write(f"HTTP/1.1 429 Too Many Requests\r\nX-Swarm-Relay: {reason}\r\n\r\n".encode())
            return
        self.circuits += 1
        reservation.circuits += 1
        self._circuits_by_ip[ip] += 1
        circuit_id = secrets.token_hex(16)
        waiting = self._waiting[circuit_id] = asyncio.get_running_loop().create_future()
        try:
            reservation.writer.write(f"CIRCUIT {circuit_id} {int(port_text)}\n".encode())
            try:
                back_reader, back_writer = await asyncio.wait_for(waiting, cfg.accept_timeout)
            except TimeoutError:
                self._refuse("not accepted")
                writer.write(b"HTTP/1.1 504 Gateway Timeout\r\n\r\n")
                return
            if int(port_text) == PUNCH_PORT:
                # where the caller's connection comes from: the only address the callee will punch to
                peername = writer.get_extra_info("peername")
                back_writer.write(f"CALLER {ip} {peername[1] if peername else 0}\n".encode())
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await splice(reader, writer, back_reader, back_writer, self.bucket, self._count)
        finally:
            self._waiting.pop(circuit_id, None)
            self.circuits -= 1
            reservation.circuits -= 1
            self._circuits_by_ip[ip] -= 1
            if not self._circuits_by_ip[ip]:
                del self._circuits_by_ip[ip]


async def _read_headers(reader: asyncio.StreamReader) -> dict[str, str]:
    """A request's header lines up to the empty one, by lower-case name (the first of each)."""
    headers: dict[str, str] = {}
    for _ in range(64):
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return headers
        name, _, value = line.decode(errors="replace").partition(":")
        headers.setdefault(name.strip().lower(), value.strip())
    raise ValueError("too many header lines")


# -- the caller's side ------------------------------------------------------------------------------


async def open_circuit(relayed: Multiaddr, port: int, timeout: float, *, member: str = "") -> socket.socket:
    """A connected, non-blocking socket to `port` of the peer behind `relayed` (a relayed address),
    spliced by its relay; raises `PeerUnreachable` if the relay or the peer cannot be reached.
    `member`: in a private swarm, this peer's `member_header` for that relay and peer."""
    if relayed.relay_id is None or relayed.peer_id is None:
        raise ValueError(f"{relayed} is not a relayed address")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    sock: socket.socket | None = None
    try:
        infos = await loop.getaddrinfo(relayed.host, relayed.port, type=socket.SOCK_STREAM)
        sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.wait_for(loop.sock_connect(sock, infos[0][4]), timeout)
        authority = f"{relayed.peer_id}:{port}"
        extra = f"{MEMBER_HEADER}: {member}\r\n" if member else ""
        await loop.sock_sendall(sock, f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{extra}\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:  # the callee speaks only after the caller's TLS hello: no overread
            chunk = await asyncio.wait_for(loop.sock_recv(sock, _LINE_LIMIT), max(0.01, deadline - loop.time()))
            if not chunk or len(head) > _HEAD_LIMIT:
                raise OSError("the relay closed the connection")
            head += chunk
        lines = head.decode(errors="replace").split("\r\n")
        status = lines[0]
        if status.split()[1:2] == ["403"]:
            why = next((line.partition(":")[2].strip() for line in lines if line.lower().startswith("x-swarm-relay:")),
                       "forbidden")
            sock.close()
            raise CircuitRefused(f"the relay {relayed.relay_id} refused a circuit to {relayed.peer_id}: {why}", why,
                                 peer_id=relayed.peer_id)
        if status.split()[1:2] != ["200"]:
            raise OSError(f"the relay answered {status!r}")
        return sock
    except (OSError, TimeoutError, IndexError) as e:
        if sock is not None:
            sock.close()
        raise PeerUnreachable(f"no circuit to {relayed}: {type(e).__name__}: {e}", peer_id=relayed.peer_id) from None


# -- the NAT'd peer's side --------------------------------------------------------------------------


class Reservation:
    """One reservation on one relay, held by a task; `ready` is set once the relay accepted it."""

    def __init__(self, owner: Reservations, relay: Multiaddr) -> None:
        self.owner = owner
        self.relay = relay
        self.ready = asyncio.Event()
        self.error = ""
        self.observed: tuple[str, int] | None = None
        """The address and port the relay saw this reservation come from (its NAT's public side)."""
        self.task = asyncio.ensure_future(self._hold())
        self.task.set_name(f"relay-reservation-{relay.peer_id}")

    @property
    def address(self) -> Multiaddr:
        return self.relay.circuit(self.owner.identity.peer_id)

    async def _hold(self) -> None:
        cfg = self.owner.config
        writer: asyncio.StreamWriter | None = None
        try:
            reader, stream = await asyncio.wait_for(
                asyncio.open_connection(self.relay.host, self.relay.port, limit=_LINE_LIMIT), cfg.connect_timeout)
            writer = stream
            stream.write(b"RESERVE\n")
            line = await asyncio.wait_for(reader.readline(), cfg.connect_timeout)
            if not line.startswith(b"NONCE "):
                raise OSError(f"not a relay: {line[:40]!r}")
            nonce = bytes.fromhex(line[6:].strip().decode())
            signature = self.owner.identity.sign(reserve_payload(nonce, self.relay.peer_id or ""))
            proof = f" {self.owner.proof.hex()}" if self.owner.proof else ""
            stream.write(f"{self.owner.identity.peer_id} {signature.hex()}{proof}\n".encode())
            line = await asyncio.wait_for(reader.readline(), cfg.connect_timeout)
            if not line.startswith(b"OK "):
                raise OSError(f"refused: {line.decode(errors='replace').strip() or 'closed'}")
            ttl = float(line[3:])
            self.ready.set()
            self.owner.changed()
            ping_every = max(0.5, min(cfg.ping_interval, ttl / 3))
            last_heard = time.monotonic()
            next_ping = last_heard + ping_every
            while True:
                # PINGs go on their own clock: a relay busy sending CIRCUITs still hears from us
                received: bytes | None
                try:
                    received = await asyncio.wait_for(reader.readline(), max(0.0, next_ping - time.monotonic()))
                except TimeoutError:
                    received = None
                if time.monotonic() >= next_ping:
                    if time.monotonic() - last_heard > 2 * ping_every + cfg.connect_timeout:
                        raise OSError("the relay stopped answering")
                    stream.write(b"PING\n")
                    await stream.drain()
                    next_ping = time.monotonic() + ping_every
                if received is None:
                    continue
                if not received:
                    raise OSError("the relay closed the reservation")
                last_heard = time.monotonic()
                if received.startswith(b"CIRCUIT "):
                    _, circuit_id, port_text = received.decode(errors="replace").split()
                    self.owner.spawn(self._answer(circuit_id, int(port_text)))
                elif received.startswith(b"OBSERVED "):
                    _, host, port_text = received.decode(errors="replace").split()
                    self.observed = (host, int(port_text))
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            self.error = f"{type(e).__name__}: {e}"
            logger.info("reservation on relay %s ended: %s", self.relay, self.error)
        finally:
            if writer is not None:
                writer.close()
            self.owner.lost(self)

    async def _answer(self, circuit_id: str, port: int) -> None:
        """Connection reversal: a fresh connection to the relay, spliced with the local server (or,
        for `PUNCH_PORT`, the callee's side of a hole punch, `holepunch.py`)."""
        punch = port == PUNCH_PORT and self.observed is not None and self.owner.punch_answer is not None
        local_port = self.owner.local_port(port)
        if local_port is None and not punch:
            return  # a port this peer does not serve: never a way into its LAN
        cfg = self.owner.config
        if punch:
            try:
                back = await asyncio.wait_for(asyncio.open_connection(self.relay.host, self.relay.port),
                                              cfg.connect_timeout)
            except (OSError, TimeoutError) as e:
                logger.debug("circuit %s not answered: %s", circuit_id, e)
                return
            back[1].write(f"ACCEPT {circuit_id}\n".encode())
            assert self.observed is not None and self.owner.punch_answer is not None
            await self.owner.punch_answer(back[0], back[1], self.observed[0], self.owner.local_port,
                                          self.owner.local_host)
            return
        try:
            back = await asyncio.wait_for(asyncio.open_connection(self.relay.host, self.relay.port), cfg.connect_timeout)
            local = await asyncio.wait_for(asyncio.open_connection(self.owner.local_host, local_port),
                                           cfg.connect_timeout)
        except (OSError, TimeoutError) as e:
            logger.debug("circuit %s not answered: %s", circuit_id, e)
            if "back" in locals():
                back[1].close()
            return
        back[1].write(f"ACCEPT {circuit_id}\n".encode())
        await splice(back[0], back[1], local[0], local[1])


@dataclass(frozen=True)
class ReservationsConfig:
    """How a NAT'd peer holds reservations.

    Attributes:
        target: reservations to hold (on distinct relays).
        connect_timeout: seconds to reach a relay and get its answer.
        ping_interval: seconds between keep-alives (at most a third of the relay's ttl).
        retry_after: seconds before a relay that failed is tried again.
    """

    target: int = 2
    connect_timeout: float = 5.0
    ping_interval: float = 5.0
    retry_after: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.target <= 8:
            raise ConfigError("hold 1..8 relay reservations")


class Reservations:
    """Keeps `config.target` reservations on relays found by `candidates`, and calls
    `on_change(addresses)` with this peer's relayed addresses whenever they change.

    Args:
        identity: this peer's identity.
        candidates: returns relays' addresses (ending in /p2p/<relay>) to try, best first.
        ports: the ports a circuit may reach: `{GRPC_PORT: grpc port, bulk port: bulk port}`.
        local_host: where this peer's own servers listen (the circuits' other end).
        proof: in a private swarm, this peer's membership proof, shown to every relay.
    """

    def __init__(self, identity: Identity, candidates: Callable[[], Awaitable[Sequence[Multiaddr]]],
                 ports: dict[int, int], local_host: str, on_change: Callable[[list[str]], None],
                 config: ReservationsConfig | None = None, *, proof: bytes = b"") -> None:
        self.identity = identity
        self.proof = proof
        self.candidates = candidates
        self.ports = ports
        self.local_host = local_host
        self.on_change = on_change
        self.config = config or ReservationsConfig()
        self.held: dict[str, Reservation] = {}  # relay PeerID -> reservation
        self._failed: dict[str, float] = {}  # relay PeerID -> monotonic time of its failure
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()  # a reservation changed, or a search found no relay to try
        self.searched_in_vain = False
        """The last search for relays found none to try (none known, or all failed recently)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._keeper: asyncio.Task[None] | None = None
        self._published: list[str] = []
        self._closing = False
        self.punch_answer: Callable[..., Awaitable[None]] | None = None
        """The callee's side of a hole punch (`holepunch.answer`), for circuits to `PUNCH_PORT`."""

    def local_port(self, port: int) -> int | None:
        return self.ports.get(port)

    @property
    def addresses(self) -> list[str]:
        return [str(r.address) for r in self.held.values() if r.ready.is_set()]

    def start(self) -> None:
        self._keeper = asyncio.ensure_future(self._keep())
        self._keeper.set_name("relay-reservations")

    async def wait_ready(self, timeout: float) -> bool:
        """Waits until one reservation holds, a search for relays found none to try (nothing to
        wait for: the keeper goes on looking), or `timeout`; True if one holds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.addresses and not self.searched_in_vain and loop.time() < deadline:
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), deadline - loop.time())
        return bool(self.addresses)

    def spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def changed(self) -> None:
        if self._closing:
            return  # shutting down: nothing to announce
        addresses = self.addresses
        if addresses != self._published:
            self._published = addresses
            self.on_change(addresses)
        self._wake.set()
        self._progress.set()

    def lost(self, reservation: Reservation) -> None:
        relay_id = reservation.relay.peer_id or ""
        if self.held.get(relay_id) is reservation:
            del self.held[relay_id]
            self._failed[relay_id] = time.monotonic()
        self.changed()

    async def _keep(self) -> None:
        """Tops the reservations up to the target; wakes when one is lost, else every few seconds."""
        while True:
            if len(self.held) < self.config.target:
                try:
                    found = await asyncio.wait_for(self.candidates(), self.config.connect_timeout * 2)
                except Exception as e:  # noqa: BLE001 - a failed discovery is retried, never fatal
                    logger.debug("finding relays failed: %s", e)
                    found = []
                now = time.monotonic()
                for relay in found:
                    if len(self.held) >= self.config.target:
                        break
                    relay_id = relay.peer_id
                    if (not relay_id or relay_id in self.held or relay_id == self.identity.peer_id
                            or now - self._failed.get(relay_id, -1e9) < self.config.retry_after):
                        continue
                    self.held[relay_id] = Reservation(self, relay)
                self.searched_in_vain = not self.held
                if self.searched_in_vain:
                    self._progress.set()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):  # a lost reservation wakes it at once
                await asyncio.wait_for(self._wake.wait(), 10.0)

    async def close(self) -> None:
        self._closing = True
        tasks = [r.task for r in self.held.values()] + list(self._tasks)
        if self._keeper is not None:
            tasks.append(self._keeper)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.held.clear()
