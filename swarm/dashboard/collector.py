"""Collector: reads the swarm's picture from the swarm itself, on the serving peer's event loop.

Every `DashboardConfig.refresh_period` it asks each peer it knows (its DHT routing table, the
peers named by runs' progress reports, up to `DashboardLimits.max_peers`) for `Info`, timing the
call; reads each named run's `<run_id>.progress` record (`swarm.optim.tracker.progress_key`,
each report parsed by `PeerProgress.from_record`, subkeys not signed by their owner skipped, as
the trainers' own tracker does); and, less often, walks the expert grids' declarations
(`swarm.moe.dht_declare.get_successors`) for the prefixes named and those the peers' answers
show. `build_view` turns that into the page's snapshot; `History` remembers it. No central
service, nothing but DHT records and peers' own answers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from swarm.core.errors import SwarmError
from swarm.core.multiaddr import Multiaddr, MultiaddrError
from swarm.core.timeutil import get_dht_time
from swarm.dashboard.view import (
    DashboardLimits,
    ExpertDeclaration,
    LinkMeasure,
    PeerAnswer,
    Picture,
    RunReports,
    Snapshot,
)
from swarm.dht.handle import KeyValueStore
from swarm.dht.validation import marker_owner
from swarm.moe.dht_declare import get_successors
from swarm.moe.uids import UID_DELIMITER, is_valid_prefix
from swarm.net.channels import ChannelPool
from swarm.optim.progress import PeerProgress, progress_key
from swarm.proto import peer_pb2

__all__ = ["Collector", "DashboardConfig", "DashboardPeer", "found_runs", "uptime", "valid_run_id"]

logger = logging.getLogger(__name__)

_MAX_RTT_S = 600.0
_MAX_THROUGHPUT = 1e12  # bytes/s: more is a lie
_MAX_COUNT = 2**53  # counts kept exact in JSON
_MAX_REJECTING = 64  # servers one client's answer may name (`swarm.core.status.MAX_REJECTING`)
_MAX_UPTIME_S = 10 * 365 * 86400.0


def _positive(value: float, limit: float, scale: float = 1.0) -> float | None:
    """`value` times `scale` if it is a positive finite number below `limit` (0 means unknown)."""
    return value * scale if math.isfinite(value) and 0 < value < limit else None


def _plausible_id(peer_id: str) -> bool:
    return 0 < len(peer_id) <= 128 and peer_id.isalnum()


def uptime(started: float, now: float) -> float | None:
    """Seconds a peer has been running, from its own clock's start and answer time; None when it
    did not say (older peers) or says nonsense."""
    if not (math.isfinite(started) and math.isfinite(now)) or started <= 0 or now < started:
        return None
    return min(now - started, _MAX_UPTIME_S)


def valid_run_id(run_id: str, max_len: int) -> bool:
    """A run id as `swarm.Optimizer` accepts one (non-empty, no spaces), short enough to show."""
    return 0 < len(run_id) <= max_len and not any(c.isspace() or not c.isprintable() for c in run_id)


def found_runs(answers: Sequence[PeerAnswer], read: Sequence[RunReports], limits: DashboardLimits) -> list[str]:
    """The runs the peers' answers name, each peer's capped (`max_runs_per_peer`), at most
    `max_runs`: those with live progress reports first, then those named by the most peers, so
    that one peer naming made-up runs cannot crowd out a run that is training."""
    named: dict[str, int] = {}
    for a in answers:
        for run_id in dict.fromkeys(a.runs[: limits.max_runs_per_peer]):
            named[run_id] = named.get(run_id, 0) + 1
    live = {r.run_id for r in read if r.reports}
    return sorted(named, key=lambda r: (r not in live, -named[r], r))[: limits.max_runs]


@dataclass(frozen=True)
class DashboardConfig:
    """What the dashboard serves and how often it looks.

    Attributes:
        host: address the page is served on; loopback unless the operator names another.
        port: TCP port (0: any free one).
        runs: training runs to show (their run ids).
        expert_prefixes: expert grids to read from the DHT (e.g. ``ffn.``), besides those the
            peers' `Info` answers name.
        refresh_period: seconds between collections (peers asked, runs read).
        experts_period: seconds between walks of the expert grids.
        info_timeout: seconds one peer has to answer `Info`.
        history_seconds: how far back the curves go.
        max_clients: pages connected at once (live updates); more are refused.
        limits: caps on what one collection keeps.
    """

    host: str = "127.0.0.1"
    port: int = 0
    runs: tuple[str, ...] = ()
    expert_prefixes: tuple[str, ...] = ()
    refresh_period: float = 2.0
    experts_period: float = 10.0
    info_timeout: float = 2.0
    history_seconds: float = 3 * 3600.0
    max_clients: int = 32
    limits: DashboardLimits = field(default_factory=DashboardLimits)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"dashboard port must be a TCP port, got {self.port}")
        if not self.host:
            raise ValueError("dashboard host must name an address (127.0.0.1 to stay on this machine)")
        if min(self.refresh_period, self.experts_period, self.info_timeout, self.history_seconds) <= 0:
            raise ValueError("dashboard periods, timeouts and history must be positive")
        if self.max_clients < 1:
            raise ValueError("dashboard max_clients must be positive")
        bad = [p for p in self.expert_prefixes if not is_valid_prefix(p if p.endswith(UID_DELIMITER)
                                                                      else p + UID_DELIMITER)]
        if bad:
            raise ValueError(f"not expert grid prefixes: {bad} (e.g. 'ffn.')")
        if any(not isinstance(r, str) or not r for r in self.runs):
            raise ValueError("run ids must be non-empty strings")


class DashboardPeer(Protocol):
    """What the collector needs of the peer that serves the page (`swarm.Peer` has it)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def dht(self) -> KeyValueStore | None: ...

    @property
    def pool(self) -> ChannelPool: ...

    def describe(self) -> peer_pb2.PeerInfo: ...


class Collector:
    """Builds snapshots of the swarm as `peer` sees it (see the module docstring).

    Args:
        peer: the serving peer.
        config: runs, grids, periods and caps.
        clock: DHT time; replaceable in tests.
    """

    def __init__(self, peer: DashboardPeer, config: DashboardConfig,
                 clock: Callable[[], float] = get_dht_time) -> None:
        self.peer = peer
        self.config = config
        self.clock = clock
        self.picture = Picture(config.limits, config.history_seconds)
        self.history = self.picture.history
        self._first_seen: dict[str, float] = {}
        self._forward: dict[str, tuple[int, float, float | None]] = {}  # calls, seconds, latency (ms)
        self._found_runs: list[str] = []
        self._experts: list[ExpertDeclaration] = []
        self._experts_read = 0  # how many times the grids were walked (the grid cache's generation)
        self._next_experts = 0.0

    async def acollect(self) -> Snapshot:
        """One collection: reads the runs, asks the peers (and walks the grids when due); the snapshot.

        The runs are the named ones (`DashboardConfig.runs`), or else those the peers' answers
        named the collection before; a run named for the first time is read at once."""
        now = self.clock()
        runs = await self._read_runs(list(self.config.runs) or self._found_runs)
        addrs = self._peer_addrs(runs)
        answers = [self._self_answer(now)]
        answers += await asyncio.gather(*(self._ask(pid, addr, now) for pid, addr in addrs.items()))
        if not self.config.runs:
            self._found_runs = found_runs(answers, runs, self.config.limits)
            read = {r.run_id for r in runs}
            runs += await self._read_runs([r for r in self._found_runs if r not in read])
        if time.monotonic() >= self._next_experts:
            self._next_experts = time.monotonic() + self.config.experts_period
            self._experts = await self._read_experts(answers)
            self._experts_read += 1
        view = self.picture.snapshot(now, self.peer.peer_id, answers, runs, self._experts, self._experts_read)
        view["runs_named"] = bool(self.config.runs)
        return view

    def _self_answer(self, now: float) -> PeerAnswer:
        info = self.peer.describe()
        info.time = time.time()  # as `Info` stamps its answers
        return self._answer(self.peer.peer_id, info, None, now)

    def _answer(self, peer_id: str, info: peer_pb2.PeerInfo, rtt_ms: float | None, now: float) -> PeerAnswer:
        """The peer's answer as the page may show it: every list capped, every number checked."""
        limits = self.config.limits
        return PeerAnswer(
            peer_id=peer_id, answered=True, role=info.role, version=info.version, reachability=info.reachability,
            client_mode=info.client_mode, experts=tuple(info.experts[: limits.max_experts_per_peer + 1]),
            relays=tuple(info.relays[:16]), rtt_ms=rtt_ms, first_seen=self._first_seen.setdefault(peer_id, now),
            uptime_s=uptime(info.started, info.time),
            links=tuple(LinkMeasure(link.peer_id, _positive(link.rtt, _MAX_RTT_S, 1000.0),
                                    _positive(link.throughput, _MAX_THROUGHPUT))
                        for link in info.links[: limits.max_links_per_peer] if _plausible_id(link.peer_id)),
            runs=tuple(r for r in info.runs[: limits.max_runs_per_peer] if valid_run_id(r, limits.max_text)),
            expert_load=tuple((load.uid, min(load.batches, _MAX_COUNT), load.queued)
                              for load in info.expert_load[: limits.max_experts_per_peer]),
            forward_ms=self._forward_latency(peer_id, info.forward_calls, info.forward_seconds),
            rejected=tuple((r.server, min(r.count, _MAX_COUNT)) for r in info.rejected[:_MAX_REJECTING]
                           if _plausible_id(r.server) and r.count > 0),
        )

    def _forward_latency(self, peer_id: str, calls: int, seconds: float) -> float | None:
        """The mean Forward time (ms) since this peer's last answer; its last figure while it served
        none since, the mean since its start at first."""
        if not (math.isfinite(seconds) and seconds >= 0) or calls <= 0:
            return None
        before = self._forward.get(peer_id)
        if before is None or calls < before[0] or seconds < before[1]:  # first seen, or restarted
            latency: float | None = seconds / calls * 1000
        elif calls > before[0]:
            latency = (seconds - before[1]) / (calls - before[0]) * 1000
        else:
            latency = before[2]
        self._forward[peer_id] = (calls, seconds, latency)
        return latency

    def _peer_addrs(self, runs: Sequence[RunReports]) -> dict[str, str]:
        """PeerID -> address of every peer to ask: the routing table's, then the trainers' own."""
        found: dict[str, str] = {}
        dht = self.peer.dht
        if dht is not None:
            for node in dht.known_peers():
                found.setdefault(node.peer_id, node.addr)
        for run in runs:
            for r in run.reports:
                if r.addr and not r.client_mode:
                    found.setdefault(r.peer_id, r.addr)
        found.pop(self.peer.peer_id, None)
        return dict(sorted(found.items())[: self.config.limits.max_peers])

    async def _ask(self, peer_id: str, addr: str, now: float) -> PeerAnswer:
        first_seen = self._first_seen.setdefault(peer_id, now)
        try:
            target = Multiaddr.parse(addr)
            if target.peer_id is None:
                target = target.with_peer_id(peer_id)
            channel = self.peer.pool.get(target)
            started = time.perf_counter()
            info = await asyncio.wait_for(channel.info(self.config.info_timeout), self.config.info_timeout)
            rtt_ms = (time.perf_counter() - started) * 1000
        except (SwarmError, MultiaddrError, TimeoutError, OSError) as e:
            logger.debug("peer %s did not answer Info: %s", peer_id, e)
            return PeerAnswer(peer_id, answered=False, first_seen=first_seen)
        if info.peer_id != peer_id:  # the channel proved its PeerID; an answer naming another is a lie
            return PeerAnswer(peer_id, answered=False, first_seen=first_seen)
        return self._answer(peer_id, info, rtt_ms, now)

    async def _read_runs(self, run_ids: Sequence[str]) -> list[RunReports]:
        dht = self.peer.dht
        if dht is None or not run_ids:
            return [RunReports(r, (), "no DHT" if dht is None else "") for r in run_ids]
        keys = [progress_key(r) for r in run_ids]
        try:
            found = await asyncio.wait_for(dht.aget_many(keys, latest=True), self.config.info_timeout * 2)
        except (SwarmError, TimeoutError, OSError) as e:
            return [RunReports(r, (), f"DHT read failed: {type(e).__name__}") for r in run_ids]
        now = self.clock()
        runs = []
        for run_id, key in zip(run_ids, keys):
            record = found.get(key)
            reports: list[PeerProgress] = []
            value = record.value if record is not None else None
            if isinstance(value, dict):
                for subkey, item in value.items():
                    owner = marker_owner(subkey)  # the subkey is signed by that peer; others anyone may write
                    if owner is None or item.expiration_time < now:
                        continue
                    report = PeerProgress.from_record(owner, item.value)
                    if report is not None:
                        reports.append(report)
                    if len(reports) >= self.config.limits.max_run_peers:
                        break
            runs.append(RunReports(run_id, tuple(reports)))
        return runs

    async def _read_experts(self, answers: Sequence[PeerAnswer]) -> list[ExpertDeclaration]:
        """Walks each grid's prefix tree breadth first, one batched read per level, up to the cap."""
        dht = self.peer.dht
        if dht is None:
            return []
        prefixes = {p if p.endswith(UID_DELIMITER) else p + UID_DELIMITER for p in self.config.expert_prefixes}
        for a in answers:
            for uid in a.experts[:64]:
                grid = uid.split(UID_DELIMITER, 1)[0] + UID_DELIMITER
                if is_valid_prefix(grid):
                    prefixes.add(grid)
        limit = self.config.limits.max_experts
        experts: dict[str, str] = {}
        level = sorted(prefixes)[:64]
        while level and len(experts) < limit:
            try:
                found = await asyncio.wait_for(get_successors(dht, level), self.config.info_timeout * 4)
            except (SwarmError, TimeoutError, OSError) as e:
                logger.debug("reading expert declarations failed: %s", e)
                break
            deeper: list[str] = []
            for parent, successors in found.items():
                for coord, (uid, addr) in sorted(successors.items()):
                    if uid == f"{parent}{coord}":
                        experts.setdefault(uid, addr)
                    else:
                        deeper.append(f"{parent}{coord}{UID_DELIMITER}")
            level = deeper[: max(0, limit - len(experts))]
        out = []
        for uid, addr in sorted(experts.items())[:limit]:
            try:
                server = Multiaddr.parse(addr).peer_id or ""
            except MultiaddrError:
                continue
            out.append(ExpertDeclaration(uid, server))
        return out
