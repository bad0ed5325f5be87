"""`swarm.Peer`: the composition root. One peer owns the event loop, the gRPC server and channels,
and the DHT; averagers, expert servers and optimizers attach to it.

Every blocking method has an awaitable twin prefixed with `a` (`shutdown` / `ashutdown`) for
code already inside an event loop, such as a Jupyter cell.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Self, TypeVar

from swarm.core.errors import ConfigError, MultiaddrError
from swarm.core.identity import Identity, IdentityFile
from swarm.core.loop import LoopThread, spawn
from swarm.core.membership import MembershipCertificate, MembershipPolicy, RevocationList
from swarm.core.multiaddr import Multiaddr
from swarm.core.services import Component, Services
from swarm.core.status import PeerStatus
from swarm.core.version import __version__
from swarm.dht.config import DHTConfig
from swarm.dht.dht import DHT
from swarm.dht.revocations import RevocationValidator, RevocationWatcher
from swarm.metrics.registry import Registry
from swarm.moe.server_role import ServerRoleValidator
from swarm.net import sealed
from swarm.net.channels import ChannelConfig, ChannelPool
from swarm.net.membership import GateConfig, MembershipGate, certificate_policy, swarm_key_policy
from swarm.net.nat import NatConfig, NatTraversal, client_direct_paths
from swarm.net.peer_service import PeerService
from swarm.net.server import RPCServer, ServerConfig, reachable_addrs
from swarm.proto import peer_pb2

logger = logging.getLogger(__name__)

T = TypeVar("T")


CALLER_ROLES = {"/swarm.Averaging/": frozenset({"trainer", "archive"})}
"""In a private swarm, the roles a caller needs: averaging and its state transfer are for trainers
(and archives, which keep a run's state). The DHT, experts and the rest take any member."""
CALLEE_ROLES = {"/swarm.moe.Expert/": frozenset({"server"})}
"""In a private swarm, the roles a callee needs: experts are called only on servers."""

_live: set[int] = set()  # the peers of this process not shut down yet
_live_lock = threading.Lock()


class Peer:
    """A swarm peer: identity, one gRPC server (unless in client mode), channels, and the DHT.

    It implements `swarm.dht.handle.PeerHandle`, the interface the averaging, mixture-of-experts
    and optimizer layers take; each of those keeps its per-peer state in `peer.services`.

    Args:
        initial_peers: multiaddrs (ending in /p2p/<PeerID>) of peers already in the swarm.
        listen: where to accept connections; port 0 picks a free port.
        identity_path: file keeping this peer's key, so its PeerID survives restarts (0600, locked).
        client_mode: only dial out (Colab, behind NAT): no server, never in others' routing tables.
        announce: addresses to advertise instead of the listen address (public IP, DNS name).
        loop: share another peer's event-loop thread (many peers in one process, e.g. simulations);
            by default each peer owns its loop.
        insecure: plaintext instead of TLS on every connection (`--insecure`; docs/security.md):
            sets `tls=False` in both configs. Such a peer talks only to peers that are insecure too.
        nat: reachability detection and relays (docs/relay.md): by default a peer asks its
            initial peers to dial it back, relays for others when reachable, and holds
            reservations on relays (announcing relayed addresses) when it is not.
        relay: shorthand for `nat.relay` ("auto", "on", "off"; True / False for on / off).
        swarm_authority: a private swarm's authority public key (`swarm-authority:…`, as
            `swarm-peer authority init` prints it); with `membership`, this peer presents its
            certificate to every peer and refuses every peer without a valid one (docs/security.md,
            "Private swarms"). None: an open swarm.
        membership: this peer's certificate (a file made by `swarm-peer invite`, or the object).
        swarm_key: a pre-shared swarm key file instead (the small-group mode, no roles or revocation).
        revocations: a revocation list to start with (a file, or the object); newer ones spread
            through the DHT and are read every `revocation_interval` seconds.
        revocation_interval: seconds between two reads of the revocation list: with one DHT
            lookup, the bound within which a revoked peer is cut off.
        gate_config: the private swarm gate's limits (refusals per address).
        start: start serving now; with False, call `await peer.astart()` from an event loop.
    """

    def __init__(
        self,
        initial_peers: Sequence[str] = (),
        listen: str = "/ip4/127.0.0.1/tcp/0",
        identity_path: str | None = None,
        client_mode: bool = False,
        *,
        announce: Sequence[str] = (),
        identity: Identity | None = None,
        role: str = "peer",
        server_config: ServerConfig | None = None,
        channel_config: ChannelConfig | None = None,
        dht_config: DHTConfig | None = None,
        loop: LoopThread | None = None,
        start: bool = True,
        insecure: bool = False,
        nat: NatConfig | None = None,
        relay: str | bool | None = None,
        swarm_authority: str | None = None,
        membership: str | os.PathLike[str] | MembershipCertificate | None = None,
        swarm_key: str | os.PathLike[str] | None = None,
        revocations: str | os.PathLike[str] | RevocationList | None = None,
        revocation_interval: float = 10.0,
        gate_config: GateConfig | None = None,
    ) -> None:
        self.initial_peers = [Multiaddr.parse(a) for a in initial_peers]
        self.listen = Multiaddr.parse(listen)
        self.announce = [Multiaddr.parse(a) for a in announce]
        self.client_mode = client_mode
        self.role = role
        if self.listen.peer_id:
            raise ConfigError(f"listen address {listen} must not name a peer")
        self._identity_file = IdentityFile(identity_path) if identity_path else None
        if identity is not None and self._identity_file is not None:
            raise ConfigError("pass identity or identity_path, not both")
        self.identity = identity or (self._identity_file.load_or_create() if self._identity_file else Identity.generate())
        self.peer_id = self.identity.peer_id
        self.addrs: list[str] = []
        self.served_experts: list[str] = []  # filled by an ExpertServer; reported by Info
        self.started = time.time()  # reported by Info (uptime)
        if insecure:
            server_config = dataclasses.replace(server_config or ServerConfig(), tls=False)
            channel_config = dataclasses.replace(channel_config or ChannelConfig(), tls=False)
        if (server_config or ServerConfig()).tls != (channel_config or ChannelConfig()).tls:
            raise ConfigError("server_config.tls and channel_config.tls differ: a peer is TLS or insecure on both")
        self.insecure = not (channel_config or ChannelConfig()).tls
        self._server_config = server_config
        if swarm_key is not None and (swarm_authority is not None or membership is not None):
            raise ConfigError("a private swarm uses certificates (swarm_authority, membership) or a swarm key, not both")
        self._certificates = certificate_policy(self.peer_id, swarm_authority, membership, revocations)
        shared_key = swarm_key_policy(self.peer_id, swarm_key)
        self.membership: MembershipPolicy | None = self._certificates or shared_key
        self.gate = MembershipGate(self.membership, gate_config, caller_roles=CALLER_ROLES, callee_roles=CALLEE_ROLES
                                   ) if self.membership is not None else None
        """A private swarm's gate (docs/security.md, "Private swarms"); None in an open swarm."""
        self.revocations: RevocationWatcher | None = None
        self._revocation_interval = revocation_interval
        if self._certificates is not None and self.gate is not None:  # roles: only servers declare experts
            dht_config = dataclasses.replace(dht_config or DHTConfig(), validators=(
                *(dht_config or DHTConfig()).validators, RevocationValidator(self._certificates.authority),
                ServerRoleValidator(self.gate)))
        self.pool = ChannelPool(self.identity, channel_config, gate=self.gate)
        self.server: RPCServer | None = None
        self.dht: DHT | None = None
        self.metrics_registry = Registry()
        """This peer's own metrics (rendered in its scrape beside the process-wide `swarm.metrics.REGISTRY`)."""
        self.services = Services()
        """The per-peer state of the layers above (averaging RPCs, expert server, served states)."""
        self._dht_config = dht_config
        nat = nat or NatConfig()
        if relay is not None:
            nat = dataclasses.replace(nat, relay={True: "on", False: "off"}.get(relay, relay))  # type: ignore[arg-type]
        self._nat_config = nat
        self.nat: NatTraversal | None = None
        """Reachability and relays; None in client mode (docs/relay.md)."""
        self._components: list[Component] = []
        self._owns_loop = loop is None
        self.loop = loop or LoopThread(name=f"swarm-{self.peer_id[-6:]}")
        self._closed = False
        with _live_lock:
            _live.add(id(self))
        if start:
            try:
                self.loop.run(self.astart())
            except BaseException:
                self.shutdown()
                raise

    async def astart(self) -> None:
        """Starts the server and joins the DHT (runs on the peer's loop)."""
        if self.loop.loop is not _running_loop():
            return await self.loop.wrap(self.astart())
        if not self.client_mode:
            self.server = RPCServer(self.identity, self._server_config, gate=self.gate)
            PeerService(self.server, self.describe)
            port = await self.server.start(self.listen)
            self.addrs = reachable_addrs(self.listen, port, self.peer_id, self.announce)
            self.nat = self.services.add(NatTraversal(self.pool, self.server, self.listen, self.addrs,
                                                      self._known_peers, self._nat_config))
            await self.nat.start()
        elif self._nat_config.holepunch:  # a client punches too (docs/relay.md, "Hole punching")
            self.pool.direct_paths = await client_direct_paths(self.pool, self.initial_peers)
        await self._start_dht()
        logger.info("peer %s ready at %s", self.peer_id, ", ".join(self.addrs) or "(client mode)")

    async def _start_dht(self) -> None:
        self.dht = await DHT.create(self, self._dht_config)
        self._components.append(self.dht)
        if self.gate is not None:
            self.gate.on_revoked.append(self._cut_off)
            if self._certificates is not None:
                self.revocations = RevocationWatcher(self.dht, self._certificates, self.gate,
                                                     self._revocation_interval)
                self._components.append(self.revocations)
                self.revocations.start()
        if self.nat is not None and not self.dht.node.client_mode:
            self.nat.on_addrs_changed.append(self.dht.node.protocol.readdress)  # relays changed (docs/relay.md)

    def _known_peers(self) -> list[Multiaddr]:
        """Peers to ask for dial-backs and relays: the initial peers, then the DHT's contacts."""
        known = list(self.initial_peers)
        if self.dht is not None:
            for node in self.dht.known_peers():
                try:
                    known.append(Multiaddr.parse(node.addr).with_peer_id(node.peer_id))
                except MultiaddrError:
                    continue
        return known

    def _cut_off(self, peer_ids: set[str]) -> None:
        """Closes the channels to peers a revocation list cut off (their calls are refused already)."""
        for peer_id in peer_ids:
            if self.pool.known(peer_id) is not None:
                spawn(self.pool.forget(peer_id), f"cut-off-{peer_id[-6:]}")

    def attach(self, component: Component) -> None:
        """Registers a component to shut down (in reverse order) before the server stops."""
        self._components.append(component)

    def detach(self, component: Component) -> None:
        if component in self._components:
            self._components.remove(component)

    def describe(self) -> peer_pb2.PeerInfo:
        info = peer_pb2.PeerInfo(
            peer_id=self.peer_id, version=__version__, addrs=self.addrs, role=self.role,
            client_mode=self.client_mode, experts=self.served_experts,
            reachability=self.nat.status if self.nat is not None else "",
            relays=[r.relay_id or "" for r in map(Multiaddr.parse, self.addrs) if r.relay_id],
            started=self.started,
        )
        _add_status(self, info)
        return info

    def run(self, coro: Coroutine[object, None, T], timeout: float | None = None) -> T:
        """Runs a coroutine on the peer's event loop and waits for it (the sync bridge)."""
        return self.loop.run(coro, timeout)

    async def ashutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for component in reversed(self._components):
            try:
                await component.ashutdown()
            except Exception:
                logger.exception("error while shutting down %r", component)
        self._components.clear()
        if self.nat is not None:
            await self.nat.close()
        elif self.pool.direct_paths is not None:
            await self.pool.direct_paths.close()  # a client's (client_direct_paths)
        if self.server is not None:
            await self.server.stop()
        await self.pool.close()

    def shutdown(self) -> None:
        """Leaves the swarm: stops components (checkpoints saved), the server, then the loop."""
        try:
            if not self._closed and not self.loop.loop.is_closed():
                self.loop.run(self.ashutdown(), timeout=30)
        finally:
            self._closed = True
            if self._owns_loop:
                self.loop.stop()
            if self._identity_file is not None:
                self._identity_file.release()
            with _live_lock:
                _live.discard(id(self))
                last = not _live
            if last:
                sealed.stop_workers()  # the process's sealing threads, shared by its peers

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Peer({self.peer_id}, addrs={self.addrs})"


_MAX_LINKS = 32
_MAX_EXPERT_LOADS = 1024
# swarm.moe.protocol.FORWARD and swarm.moe.group_calls.FORWARD_GROUP (that package needs torch)
_EXPERT_FORWARDS = ("/swarm.moe.Expert/Forward", "/swarm.moe.Expert/ForwardGroup")


def _add_status(peer: Peer, info: peer_pb2.PeerInfo) -> None:
    """What `Peer.describe` adds for the swarm's page (docs/operations.md, "Dashboard"), capped:
    its own link measurements, its runs, its experts' load and latency, the servers it rejected."""
    info.links.extend(peer_pb2.LinkStat(peer_id=pid, rtt=link.srtt or 0.0, throughput=link.throughput or 0.0)
                      for pid, link in reversed(list(peer.pool.estimates.links.items())[-_MAX_LINKS:]))
    status = peer.services.get(PeerStatus)
    if status is not None:
        info.runs.extend(status.runs)
        info.rejected.extend(peer_pb2.RejectedAnswers(server=s, count=n) for s, n in status.rejected.items())
    if peer.served_experts:
        info.expert_load.extend(_expert_loads(peer.served_experts[:_MAX_EXPERT_LOADS]))
        methods = peer.server.metrics.methods if peer.server is not None else {}
        for forward in filter(None, map(methods.get, _EXPERT_FORWARDS)):
            info.forward_calls += sum(forward.latency.counts)
            info.forward_seconds += forward.latency.sum


def _expert_loads(uids: Sequence[str]) -> list[peer_pb2.ExpertLoad]:
    """Each expert's batches and queue, from the process's expert metrics (prometheus_client is
    already loaded on a peer that serves experts)."""
    from swarm.metrics import EXPERT_BATCHES, EXPERT_QUEUE_DEPTH

    batches: dict[str, float] = {}
    queued: dict[str, float] = {}
    for family, into, suffix in ((EXPERT_BATCHES, batches, "_total"), (EXPERT_QUEUE_DEPTH, queued, "")):
        for metric in family.collect():
            for sample in metric.samples:
                if sample.name == metric.name + suffix and "expert" in sample.labels:
                    into[sample.labels["expert"]] = sample.value
    return [peer_pb2.ExpertLoad(uid=uid, batches=_count(batches.get(uid, 0.0)), queued=_count(queued.get(uid, 0.0)))
            for uid in uids]


def _count(value: float) -> int:
    return int(value) if math.isfinite(value) and value > 0 else 0  # a failed gauge probe reads NaN


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
