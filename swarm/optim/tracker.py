"""ProgressTracker: reports this peer's progress in the DHT and follows the swarm's, without polling.

One owned background task on the peer's event loop does all DHT traffic; the training thread only
sets fields and reads a snapshot, so a training step never waits for the network to learn where
the swarm is. Reports are throttled to one per `report_period` (plus one at once when the epoch
changes; with no target batch, as in DiLoCo mode, where nobody waits on sample counts, one per
heartbeat of `progress_expiration / 3` in between); the swarm's reports are read again when the target batch is expected to be reached
(clamped between `min_refresh_period` and `max_refresh_period`), as hivemind's ProgressTracker
does, so a peer idles on a timer instead of asking the DHT every step.

A peer that is one of the progress key's replicas (`KeyValueStore.holds_replica`: in a swarm of
up to `DHTConfig.num_replicas` DHT nodes, every one) holds every peer's report in its own storage
as soon as that peer's store reaches it, so it reads its own copy instead of asking the network:
at once whenever a store changes it (`watch_local`), which is both fresher (no wait for the next
read) and cheaper (no Find RPCs, no signatures checked again). It still reads the network every
`max_refresh_period`, and first, to take in what its copy missed (a store that did not reach it, a
newcomer's empty storage); each report counts in its newest form from either source.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import replace

from swarm.core.errors import DHTError, SwarmError
from swarm.core.loop import spawn
from swarm.core.status import PeerStatus
from swarm.core.timeutil import get_dht_time
from swarm.dht.expiring import ValueWithExpiration, subkey_entries
from swarm.dht.handle import PeerHandle
from swarm.dht.validation import marker_owner, owner_marker
from swarm.optim.config import CollaborationConfig
from swarm.optim.outcome import RoundOutcome
from swarm.optim.progress import (
    PeerProgress,
    RoundSummary,
    SwarmProgress,
    merge_read,
    progress_key,
    summarize,
)

__all__ = ["ProgressTracker", "progress_key"]

logger = logging.getLogger(__name__)


class ProgressTracker:
    """Keeps this peer's progress record fresh in the DHT and the swarm's records in memory.

    Args:
        peer: the `swarm.Peer` whose DHT and event loop are used.
        run_id: the training run's name; peers of one run share it.
        config: collaboration settings (report period, refresh bounds, expiration).
        addr: the multiaddr others can download this peer's state from ("" in client mode).
        clock: DHT time (seconds since the epoch); replaceable in tests.
    """

    def __init__(self, peer: PeerHandle, run_id: str, config: CollaborationConfig, addr: str = "",
                 clock: Callable[[], float] = get_dht_time) -> None:
        self.peer = peer
        self.run_id = run_id
        self.key = progress_key(run_id)
        self.config = config
        self.addr = addr
        self.clock = clock
        self._lock = threading.Lock()
        self._local = PeerProgress(peer.peer_id, 0, 0, 0.0, clock(), peer.client_mode, addr,
                                   target_batch_size=config.target_batch_size)
        self._reports: dict[str, PeerProgress] = {}
        self._expires: dict[str, float] = {}  # when each report's record expires in the DHT
        self._dirty = True
        self._urgent = False
        self._last_report = 0.0
        self._last_expiration = 0.0
        self._next_fetch = 0.0
        self._fetched = asyncio.Event()
        self._changed = threading.Condition(self._lock)
        self._wake: asyncio.Event | None = None
        self._next_reports: asyncio.Event | None = None  # set (and replaced) by each read of the DHT
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._local_news = False  # a store changed this node's copy of the key since the last read
        self._next_network_fetch = 0.0  # a replica reads the network again then (0: before reading locally)
        self._unwatch: Callable[[], None] | None = None
        self.reads = {"network": 0, "local": 0}
        """How many times the swarm's progress was read from the network and from this node's
        own copy (diagnostics, benchmarks)."""

    # -- training thread ----------------------------------------------------------------------

    def update(self, epoch: int, samples: int, samples_per_second: float, digest: str, *,
               urgent: bool = False) -> None:
        """Records this peer's progress; it reaches the DHT within `report_period` (at once if urgent)."""
        with self._lock:
            changed_epoch = epoch != self._local.epoch
            self._local = PeerProgress(self.peer.peer_id, epoch, samples, samples_per_second, self.clock(),
                                       self.peer.client_mode, self.addr, digest, self._local.loss,
                                       self.config.target_batch_size, self._local.last_round)
            wake = not self._dirty or urgent or changed_epoch
            self._dirty = True
            self._urgent = self._urgent or urgent or changed_epoch
        if wake and self._wake is not None and not self._closed:
            self.peer.loop.loop.call_soon_threadsafe(self._wake.set)

    def report_loss(self, loss: float) -> None:
        """Adds the trainer's current training loss to this peer's reports (from the next one on),
        for people watching the run; training never reads it. A NaN or infinite loss is left out."""
        if not isinstance(loss, (int, float)):
            raise TypeError(f"loss must be a number, got {type(loss).__name__}")
        with self._lock:
            self._local = replace(self._local, loss=float(loss) if math.isfinite(loss) else None)

    def report_round(self, outcome: RoundOutcome) -> None:
        """Adds this peer's last collective step to its reports (from the next one on), for people
        watching the run (group size, members in the mean, time); training never reads it."""
        with self._lock:
            self._local = replace(self._local, last_round=RoundSummary.of(outcome))

    @property
    def local(self) -> PeerProgress:
        return self._local

    @property
    def progress(self) -> SwarmProgress:
        """The swarm's progress as of now: the last reports read, with this peer's fresh one."""
        with self._lock:
            reports, local = list(self._reports.values()), self._local
        return summarize(reports, local, self.config.target_batch_size, self.clock(),
                         extrapolate_for=2 * self.config.report_period + self.config.max_refresh_period)

    def progress_ahead(self, epoch: int) -> SwarmProgress:
        """The swarm's progress towards the round after `epoch`'s, while that round is averaged.

        The peers at `epoch` are averaging it (as this one is) and what they report is what they
        accumulated since: it counts towards the next round, with the peers already past it.
        """
        with self._lock:
            reports = [replace(r, epoch=epoch + 1) if r.epoch == epoch else r for r in self._reports.values()]
            local = replace(self._local, epoch=max(self._local.epoch, epoch + 1))
        return summarize(reports, local, self.config.target_batch_size, self.clock(),
                         extrapolate_for=2 * self.config.report_period + self.config.max_refresh_period)

    def peers_at(self, epoch: int) -> list[PeerProgress]:
        """Other live peers whose last report is at `epoch` or later (candidates to download state from)."""
        with self._lock:
            return [r for r in self._reports.values() if r.epoch >= epoch and r.peer_id != self.peer.peer_id]

    def reports(self) -> list[PeerProgress]:
        """Every live peer's last report, this peer's current one included."""
        with self._lock:
            others = [r for r in self._reports.values() if r.peer_id != self.peer.peer_id]
            return [*others, self._local]

    def wait_for(self, predicate: Callable[[SwarmProgress], bool], timeout: float) -> bool:
        """Blocks until `predicate(progress)` holds after a read of the DHT; False on timeout."""
        deadline = self.clock() + timeout
        self.request_refresh()
        with self._changed:
            while True:
                reports, local = list(self._reports.values()), self._local
                progress = summarize(reports, local, self.config.target_batch_size, self.clock(), 0.0)
                left = deadline - self.clock()
                if predicate(progress):
                    return True
                if left <= 0:
                    return False
                self._changed.wait(min(left, self.config.max_refresh_period))

    async def wait_until(self, predicate: Callable[[SwarmProgress], bool]) -> SwarmProgress:
        """Returns the swarm's progress once `predicate` holds: now, or after a later read of the DHT.

        Runs on the peer's loop; e.g. `predicate=lambda p: p.num_peers == 1` waits until every other
        peer left or died.
        """
        while True:
            if self._next_reports is None:
                raise RuntimeError("the tracker is not running")
            reports = self._next_reports
            progress = self.progress
            if predicate(progress):
                return progress
            await reports.wait()

    def request_refresh(self) -> None:
        """Asks the background task to read the swarm's progress now (thread-safe)."""
        self._next_fetch = 0.0
        if self._wake is not None and not self._closed:
            self.peer.loop.loop.call_soon_threadsafe(self._wake.set)

    # -- event loop ---------------------------------------------------------------------------

    async def astart(self) -> None:
        """Starts the background task (on the peer's loop) and reads the swarm's progress once."""
        if self.peer.loop.loop is not _running_loop():
            return await self.peer.loop.wrap(self.astart())
        self._wake = asyncio.Event()
        self._next_reports = asyncio.Event()
        if self.peer.dht is not None:
            self._unwatch = self.peer.dht.watch_local(self.key, self._on_local_store)
        self._task = spawn(self._run(), name=f"progress-tracker:{self.key}")
        PeerStatus.of(self.peer).join_run(self.run_id)  # the peer's Info answer names its runs
        try:
            await asyncio.wait_for(self._fetched.wait(), self.config.averaging_timeout)
        except TimeoutError:
            logger.warning("could not read the swarm's progress from the DHT within %.0f s",
                           self.config.averaging_timeout)

    async def _run(self) -> None:
        assert self._wake is not None
        heartbeat = self.config.progress_expiration / 3
        # with no target batch (DiLoCo) no peer's round waits for the others' sample counts: a
        # report that only moves them on is not worth its DHT stores, so between epoch changes
        # (urgent, at once) a peer reports at the heartbeat only
        period = self.config.report_period if self.config.target_batch_size is not None else heartbeat
        while not self._closed:
            now = self.clock()
            if not self._dirty and now >= self._last_report + heartbeat:
                self._dirty = True  # keep the record alive while training waits (averaging, downloads)
            if self._dirty and (self._urgent or now >= self._last_report + period):
                await self._report()
            if now >= self._next_fetch or self._local_news:
                await self._read(now, scheduled=now >= self._next_fetch)
            now = self.clock()
            due = min(self._next_fetch, self._last_report + heartbeat)
            if self._local_news:
                due = now
            if self._dirty:
                due = min(due, now if self._urgent else self._last_report + period)
            self._wake.clear()
            if due > now:
                try:
                    await asyncio.wait_for(self._wake.wait(), due - now)
                except TimeoutError:
                    pass

    async def _report(self) -> None:
        with self._lock:
            local = self._local
            self._dirty = self._urgent = False
        now = self.clock()
        # a store must expire later than the previous one to replace it (docs/protocol.md, "DHT records")
        expiration = max(now + self.config.progress_expiration, self._last_expiration + 1e-3)
        self._last_report = now
        try:
            if self.peer.dht is None:
                raise DHTError("this peer has no DHT to report progress to")
            ok = await self.peer.dht.astore(self.key, local.to_record(), expiration,
                                            subkey=owner_marker(local.peer_id))
        except (TimeoutError, SwarmError, OSError) as e:
            ok = False
            logger.debug("progress report failed: %s", e)
        if ok:
            self._last_expiration = expiration
        else:
            with self._lock:
                self._dirty = True  # try again at the next report period

    def _on_local_store(self) -> None:
        self._local_news = True
        if self._wake is not None:
            self._wake.set()

    async def _read(self, now: float, scheduled: bool) -> None:
        """Reads the swarm's progress: this node's own copy where it is a replica (module
        docstring), else, or when a network read is due, the network. News of a store to a node
        that is no replica (a writer that counts it among the nearest) is ignored: it would make
        every such store cost a network read."""
        self._local_news = False
        dht = self.peer.dht
        replica = dht is not None and self._next_network_fetch > 0 and dht.holds_replica(self.key)
        if replica and now < self._next_network_fetch:
            assert dht is not None
            self.reads["local"] += 1
            self._absorb(dht.local_copy(self.key))
        elif scheduled or replica:  # a replica whose network read is due takes it with the news
            await self._fetch()

    async def _fetch(self) -> None:
        cfg = self.config
        self.reads["network"] += 1
        try:
            if self.peer.dht is None:
                raise DHTError("this peer has no DHT to read progress from")
            found = await self.peer.dht.aget(self.key, latest=True)
        except (TimeoutError, SwarmError, OSError) as e:
            # keep what we knew: a failed read is no news (taking it for "everyone left" would make
            # this peer step alone and leave the swarm's state)
            logger.debug("reading the swarm's progress failed: %s", e)
            self._fetched.set()
            self._next_fetch = self.clock() + cfg.min_refresh_period
            return
        self._next_network_fetch = self.clock() + cfg.max_refresh_period
        self._absorb(found)

    def _absorb(self, found: ValueWithExpiration | None) -> None:
        """Takes in a read of the progress key (`aget`'s or `local_copy`'s value) and schedules the
        next read."""
        cfg = self.config
        read: dict[str, tuple[PeerProgress, float]] = {}
        left: set[str] = set()
        for subkey, item in subkey_entries(found).items():
            peer_id = marker_owner(subkey)  # signed by that peer; other subkeys anyone may write
            if peer_id is None:
                continue
            record = item.value
            if isinstance(record, dict) and record.get("left"):
                left.add(peer_id)
                continue
            report = PeerProgress.from_record(peer_id, record)
            if report is not None:
                read[report.peer_id] = (report, item.expiration_time)
        now = self.clock()
        with self._lock:
            known = {p: (r, self._expires.get(p, 0.0)) for p, r in self._reports.items()}
            merged = merge_read(known, read, left, now)  # a record this read missed counts until it expires
            self._reports = {p: r for p, (r, _) in merged.items()}
            self._expires = {p: e for p, (_, e) in merged.items()}
            self._changed.notify_all()
        self._fetched.set()
        if self._next_reports is not None:
            done, self._next_reports = self._next_reports, asyncio.Event()
            done.set()
        progress = self.progress
        # read again when the target is expected to be reached; once it is, at the pace peers report
        wait = progress.eta if progress.eta > 0 else cfg.report_period
        self._next_fetch = self.clock() + min(max(wait, cfg.min_refresh_period), cfg.max_refresh_period)

    async def ashutdown(self) -> None:
        """Stops the task and withdraws this peer's record, so others stop counting it at once."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            PeerStatus.of(self.peer).leave_run(self.run_id)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self._last_expiration and self.peer.dht is not None:
            try:
                await asyncio.wait_for(self.peer.dht.astore(
                    self.key, {"left": True}, self._last_expiration + 1e-3, subkey=owner_marker(self.peer.peer_id)),
                    2.0)
            except (TimeoutError, SwarmError, OSError):
                pass  # the record expires by itself


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
