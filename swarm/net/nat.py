"""What a peer does about NAT at start (docs/relay.md): detect its reachability, then relay for
others if it is reachable, or hold reservations on relays and announce relayed addresses if not.

`NatTraversal` is the policy; `swarm.Peer` runs it between starting its server and joining the
DHT, so the DHT and everything above it see the addresses others can actually dial.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from swarm.core.errors import ConfigError, MultiaddrError, RPCError
from swarm.core.multiaddr import Multiaddr
from swarm.net.channels import ChannelPool
from swarm.net.holepunch import DirectPaths, PunchGuard, PunchLimits, answer
from swarm.net.reachability import (
    PRIVATE,
    PUBLIC,
    UNKNOWN,
    DialBackService,
    Reachability,
    call_dial_back,
    detect,
)
from swarm.net.relay import GRPC_PORT, Relay, RelayConfig, Reservations, ReservationsConfig
from swarm.net.server import RPCServer

logger = logging.getLogger(__name__)

_MODES = ("auto", PUBLIC, PRIVATE)


@dataclass(frozen=True)
class NatConfig:
    """Attributes:
        reachability: "auto" (ask peers to dial back), or "public" / "private" to skip asking.
        relay: "auto" (relay when not private), "on" or "off".
        relay_port: the relay's TCP port (0: any free port).
        relay_limits: the relay's limits.
        reservations: how many relays a private peer holds, and how.
        detect_timeout: seconds for the dial-back round.
        first_reservation_timeout: seconds a private peer waits at start for its first relay.
        recheck_interval: seconds after start before reachability is asked again ("auto" only;
            None: never); the pause doubles while the answer stays the same, up to `recheck_max`,
            and starts over when it changes.
        recheck_max: the longest pause between two checks.
        holepunch: dial relayed peers directly when a hole punch works (`holepunch.py`).
        punch_limits: how many punches this peer answers, per caller, per network and in all.
    """

    reachability: str = "auto"
    relay: str = "auto"
    relay_port: int = 0
    relay_limits: RelayConfig = field(default_factory=RelayConfig)
    reservations: ReservationsConfig = field(default_factory=ReservationsConfig)
    detect_timeout: float = 3.0
    first_reservation_timeout: float = 10.0
    recheck_interval: float | None = 60.0
    recheck_max: float = 1800.0
    holepunch: bool = True
    punch_limits: PunchLimits = field(default_factory=PunchLimits)

    def __post_init__(self) -> None:
        if self.reachability not in _MODES:
            raise ConfigError(f"reachability must be one of {', '.join(_MODES)}, got {self.reachability!r}")
        if self.relay not in ("auto", "on", "off"):
            raise ConfigError(f"relay must be auto, on or off, got {self.relay!r}")
        if not 0 <= self.relay_port <= 65535:
            raise ConfigError(f"relay port must be a TCP port, got {self.relay_port}")
        if (self.recheck_interval is not None and self.recheck_interval <= 0) or self.recheck_max <= 0:
            raise ConfigError("reachability recheck intervals must be positive (recheck_interval None: never)")


class NatTraversal:
    """Runs `NatConfig`'s policy for one peer.

    Args:
        pool: the peer's channels.
        server: the peer's started server.
        listen: its listen address (the relay listens on the same host).
        addrs: its advertised addresses; replaced in place by relayed ones when it is private, so
            whoever holds the list (the DHT, the expert server) announces the new ones.
        known_peers: returns peers to ask for dial-backs and relays (initial peers, DHT contacts).
    """

    def __init__(self, pool: ChannelPool, server: RPCServer, listen: Multiaddr, addrs: list[str],
                 known_peers: Callable[[], Sequence[Multiaddr]], config: NatConfig | None = None) -> None:
        self.pool = pool
        self.server = server
        self.listen = listen
        self.addrs = addrs
        self.direct_addrs = list(addrs)
        self.known_peers = known_peers
        self.config = config or NatConfig()
        self.reachability = Reachability()
        self.relay: Relay | None = None
        self.reservations: Reservations | None = None
        self.relay_addr = ""
        self.on_addrs_changed: list[Callable[[list[str]], None]] = []
        self._watcher: asyncio.Task[None] | None = None
        self.direct_paths: DirectPaths | None = None
        self._rechecking = asyncio.Lock()
        self.punch_guard = PunchGuard(self.config.punch_limits)
        """The punches this peer answered and refused (as a callee behind NAT)."""
        DialBackService(server, lambda: self.relay_addr, tls=pool.config.tls)

    @property
    def status(self) -> str:
        return self.reachability.status

    def plan(self) -> str:
        """What this peer does about its reachability, in one line for humans."""
        parts = [self.reachability.summary()]
        if self.relay is not None:
            parts.append(f"relaying for peers behind NAT at {self.relay_addr}")
        if self.reservations is not None:
            held = self.reservations.addresses
            parts.append(f"reachable through {len(held)} relay(s)" if held else
                         "no relay reachable yet: others cannot dial this peer until one is found")
        return "; ".join(parts)

    async def start(self) -> None:
        cfg = self.config
        if cfg.reachability == "auto":
            self.reachability = await detect(self.pool, list(self.known_peers()), self.direct_addrs,
                                             timeout=cfg.detect_timeout)
        else:
            self.reachability = Reachability(status=cfg.reachability)
        logger.info("reachability: %s", self.reachability.summary())
        if not self._may_relay():
            if cfg.relay == "on":
                logger.warning("not relaying: this peer's membership in its private swarm lacks the relay role")
        elif cfg.relay == "on" or (cfg.relay == "auto" and self.status != PRIVATE):
            await self._start_relay()
        if self.status == PRIVATE:
            await self._start_reservations()
        if cfg.holepunch and self.pool.direct_paths is None:
            self.direct_paths = DirectPaths(self.public_ip)
            await self.direct_paths.start()
            self.pool.direct_paths = self.direct_paths
        if cfg.reachability == "auto" and cfg.recheck_interval is not None:
            self._watcher = asyncio.ensure_future(self._watch(cfg.recheck_interval))
            self._watcher.set_name("nat-recheck")

    def _may_relay(self) -> bool:
        """In a private swarm only members with the relay role relay; in an open one, anyone."""
        gate = self.pool.gate
        return gate is None or gate.own.has("relay")

    def public_ip(self) -> str | None:
        """This peer's IP address as peers elsewhere see it, for a hole punch: what a relay saw a
        reservation come from, or a public peer's own address; None on loopback or unknown."""
        found: str | None = None
        if self.reservations is not None:
            found = next((r.observed[0] for r in self.reservations.held.values() if r.observed), None)
        elif self.status == PUBLIC:
            found = next((a.host for a in map(Multiaddr.parse, self.direct_addrs) if a.protocol == "ip4"), None)
        return None if found is None or found.startswith("127.") else found

    async def recheck(self) -> bool:
        """Asks peers to dial back again and acts on a changed answer (e.g. a port forwarded, or
        the address changed): a peer that became reachable announces its direct addresses and drops
        its reservations (and relays, with `relay="auto"`); one that became private stops relaying
        and reserves on relays. Nobody answering changes nothing. Returns whether it changed."""
        cfg = self.config
        async with self._rechecking:
            found = await detect(self.pool, list(self.known_peers()), self.direct_addrs, timeout=cfg.detect_timeout)
            was_private = self.status == PRIVATE
            if found.status == UNKNOWN or (found.status == PRIVATE) == was_private:
                if found.status == self.status:
                    self.reachability = found
                return False
            self.reachability = found
            logger.info("reachability changed: %s", found.summary())
            if found.status == PRIVATE:
                if self.relay is not None and cfg.relay == "auto":
                    relay, self.relay, self.relay_addr = self.relay, None, ""
                    await relay.stop()  # nobody can dial it now
                await self._start_reservations()
            else:
                if self.reservations is not None:
                    reservations, self.reservations = self.reservations, None
                    await reservations.close()
                self._announce(self.direct_addrs)
                if self.relay is None and cfg.relay == "auto" and self._may_relay():
                    await self._start_relay()
            return True

    async def _watch(self, interval: float) -> None:
        """Rechecks reachability with a backoff: the pause doubles while nothing changes."""
        pause = interval
        while True:
            await asyncio.sleep(pause)  # a period, not a wait for an event
            try:
                changed = await self.recheck()
            except Exception as e:  # noqa: BLE001 - a failed check is tried again later, never fatal
                logger.debug("reachability recheck failed: %s", e)
                changed = False
            pause = interval if changed else min(2 * pause, self.config.recheck_max)

    async def _start_relay(self) -> None:
        self.relay = Relay(self.server.identity, self.config.relay_limits, gate=self.pool.gate)
        host = "0.0.0.0" if self.listen.is_unspecified and self.listen.protocol == "ip4" else self.listen.host
        port = await self.relay.start(host, self.config.relay_port)
        direct = [Multiaddr.parse(a) for a in self.direct_addrs]
        best = next((a for a in direct if not a.host.startswith("127.")), direct[0] if direct else None)
        if best is not None:
            self.relay_addr = str(best.with_port(port))

    async def _start_reservations(self) -> None:
        ports = {GRPC_PORT: self.server.port or 0}
        bulk_port = self.server.bulk.port if self.server.bulk is not None else None
        if bulk_port:
            ports[bulk_port] = bulk_port
        local = self.listen.host if not self.listen.is_unspecified else (
            "127.0.0.1" if self.listen.protocol == "ip4" else "::1")
        gate = self.pool.gate
        self.reservations = Reservations(self.server.identity, self._find_relays, ports, local, self._relayed,
                                         self.config.reservations, proof=gate.policy.proof if gate else b"")
        if self.config.holepunch:
            self.reservations.punch_answer = functools.partial(answer, guard=self.punch_guard)
        self.reservations.start()
        if not await self.reservations.wait_ready(self.config.first_reservation_timeout):
            logger.warning("behind NAT and no relay accepted a reservation yet: others cannot dial this peer "
                           "(still trying; a peer that only trains can use --client-mode)")

    async def _find_relays(self) -> list[Multiaddr]:
        """Relays to reserve on: those the dial-back answers named, then ones other known peers name."""
        found = {r.peer_id: r for r in self.reachability.relays}
        if self.reservations is not None:
            asked = [p for p in self.known_peers() if p.peer_id not in found][:8]
            answers = await asyncio.gather(*(call_dial_back(self.pool, p, (), self.config.detect_timeout)
                                             for p in asked), return_exceptions=True)
            for answer in answers:
                if isinstance(answer, BaseException):
                    if isinstance(answer, RPCError | TimeoutError | MultiaddrError):
                        continue
                    raise answer
                if not answer.relay:
                    continue
                with contextlib.suppress(MultiaddrError):
                    relay = Multiaddr.parse(answer.relay)
                    found.setdefault(relay.peer_id, relay)
                    if relay not in self.reachability.relays:
                        self.reachability.relays.append(relay)
        gate = self.pool.gate
        if gate is not None:  # a private swarm: only members with the relay role relay
            found = {peer_id: r for peer_id, r in found.items()
                     if (member := gate.member(peer_id or "")) is not None and member.has("relay")}
        return list(found.values())

    def _relayed(self, addresses: list[str]) -> None:
        logger.info("relayed addresses: %s", ", ".join(addresses) or "(none: no relay holds a reservation)")
        self._announce(addresses or self.direct_addrs)

    def _announce(self, addresses: list[str]) -> None:
        if addresses == self.addrs:
            return
        self.addrs[:] = addresses
        for callback in self.on_addrs_changed:
            callback(list(self.addrs))

    async def close(self) -> None:
        if self.direct_paths is not None:
            await self.direct_paths.close()
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        async with self._rechecking:  # a recheck in progress ends first: nothing is started after this
            pass
        if self.reservations is not None:
            await self.reservations.close()
        if self.relay is not None:
            await self.relay.stop()


async def client_direct_paths(pool: ChannelPool, peers: Sequence[Multiaddr], timeout: float = 3.0) -> DirectPaths | None:
    """Hole punching for a client-mode peer (Colab: it runs no `NatTraversal`, holds no relay): its
    public IPv4 address is what the first of up to three `peers` to answer an empty `DialBack` saw
    it come from (nothing is dialed back); None (no punching, relayed peers are reached through
    their relays as before) when nobody answered or the address is loopback."""
    answers = await asyncio.gather(*(asyncio.wait_for(call_dial_back(pool, p, (), timeout), timeout)
                                     for p in list(peers)[:3]), return_exceptions=True)
    seen = next((a.observed for a in answers if not isinstance(a, BaseException) and a.observed), "")
    try:
        ip = ipaddress.IPv4Address(seen)
    except ValueError:
        return None
    if ip.is_loopback:
        return None
    paths = DirectPaths(lambda: str(ip))
    await paths.start()
    return paths


__all__ = ["PRIVATE", "PUBLIC", "UNKNOWN", "NatConfig", "NatTraversal", "client_direct_paths"]
