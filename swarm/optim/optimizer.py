"""`swarm.Optimizer`: wraps a torch optimizer so that many peers train one model together.

Two modes share one protocol:

- large-batch (default): peers accumulate gradients; when the swarm together holds
  `target_batch_size` samples, the peers average their gradients (weighted by samples) and all
  take the same optimizer step (`swarm.optim.large_batch`);
- DiLoCo (`diloco=DiLoCoConfig(...)`): peers take H local steps, then average the
  pseudo-gradient and take an outer Nesterov step (`swarm.optim.diloco`).

Around either mode: a global epoch counter (collective steps taken) that drives learning-rate
schedules; progress reports in the DHT (`swarm.optim.tracker`), throttled and read on a timer;
state download for a peer that falls behind or joins late (`swarm.optim.state_transfer`).

Catching up (large-batch mode): a peer in step with the swarm that misses one round (it came a
moment late, and the group started without it) takes that round's step from its result, the mean
gradient a member applied (`StepOutcome.caught_up`), instead of downloading the whole state: a
third of the bytes with Adam, and nothing for the server to snapshot. A member whose
group formed without a peer the round expected keeps a copy of the mean until its next round lands
and serves it; the late peer checks its new state against the fingerprint most peers at the new
epoch report, and downloads the state when it cannot catch up or the check fails.

Faults are state: every round ends in a `RoundOutcome` logged once. A failed averaging round
raises the same `AveragingError` on every member of its group (docs/architecture.md, "Life of an averaging step"), so every member
does the same thing: it keeps what it accumulated and retries at its next step; a peer whose
round fails `max_failed_rounds` times in a row while the swarm moves on re-synchronizes from
the others. No member waits on a dead peer longer than `averaging_timeout`.

Overlap (`CollaborationConfig.max_staleness` 1, the default): a round runs on the peer's loop
while `step()` returns and the trainer computes on; a later `step()` applies it once its
average arrived, and waits for it only when the next round is due first. One round at most is
in flight, so a step never applies gradients (or inner steps) older than one collective step
(`RoundOutcome.staleness`); `idle_seconds` says how long the trainer waited for rounds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict, Unpack

import torch

from swarm.core.errors import ConfigError, RPCError, SwarmError
from swarm.dht.handle import PeerHandle
from swarm.optim.archiver import load_cold_state
from swarm.optim.checkpointing import CheckpointConfig, Checkpointer
from swarm.optim.config import CollaborationConfig, DiLoCoConfig
from swarm.optim.diloco import DiLoCoMode
from swarm.optim.group_averaging import AveragerLike, RoundResult, make_swarm_averager
from swarm.optim.large_batch import LargeBatchMode
from swarm.optim.mode import TrainingMode
from swarm.optim.outcome import RoundOutcome, StepOutcome
from swarm.optim.progress import SwarmProgress, ThroughputMeter, canonical_digest, majority_digest
from swarm.optim.state_transfer import (
    StateTransferError,
    download_round_result,
    download_state,
    serve_round_result,
    serve_state,
)
from swarm.optim.tracker import ProgressTracker
from swarm.optim.training_state import TrainingState, state_digest

logger = logging.getLogger(__name__)

# A peer paced by its own steps (DiLoCo) announces its round this many times its pace's estimate
# later: the pace is a 10 s average, and on a loaded machine a round's steps took up to ~1.6x the
# estimate (tests/optim/test_diloco.py, three trainers in one process). A leader starts as soon as
# every expected peer is in, so the slack costs nothing while the peer is on time; it lengthens only
# the wait for a peer that died after announcing, by at most half the averaging timeout.
PACE_SLACK = 1.0

# With every round waited for (max_staleness 0), a trainer whose swarm is due at the target within
# this share of its own next batch's time waits for it rather than computing that batch: the
# batch would make the round wait for it (the others, at the target, stop computing), while the
# wait costs at most this share of a batch (benchmarks/history/BENCHMARKS-2026-12-05.md, "Communication overlapped with compute").
NEAR_TARGET = 0.5

# A state asked of this peer while its round is in flight (rounds overlapped) is served once that
# round has landed: taken before, it is one epoch behind by the time the round lands, and a peer
# that downloads it finds the swarm ahead again and downloads once more. After the round's
# averaging ends the trainer applies it at its next step; the server waits this many of its
# batches for that (at least `LAND_WAIT_MIN` seconds) before serving the state it holds.
LAND_WAIT_BATCHES = 2.0
LAND_WAIT_MIN = 1.0

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
AveragerFactory = Callable[[Sequence[torch.Tensor], str], AveragerLike]
ModeWrapper = Callable[[TrainingMode], TrainingMode]


class OptimizerOptions(TypedDict, total=False):
    """`Optimizer`'s keyword-only arguments (its docstring says what each means), stated once for
    it and for the constructors that pass them through (`swarm.DistributedOptimizer`)."""

    batch_size_per_step: int | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | SchedulerFactory | None
    diloco: DiLoCoConfig | None
    config: CollaborationConfig | None
    averager_factory: AveragerFactory | None
    mode_wrapper: ModeWrapper | None
    checkpoint_dir: str | Path | None
    checkpoint: CheckpointConfig | None
    resume_from: str | Path | None


def check_options(options: OptimizerOptions, of: str) -> None:
    """Raises TypeError for a keyword that is none of `OptimizerOptions` (a misspelt setting)."""
    unknown = sorted(set(options) - OptimizerOptions.__optional_keys__)
    if unknown:
        raise TypeError(f"{of} got unexpected keyword arguments {unknown}; it takes "
                        f"{sorted(OptimizerOptions.__optional_keys__)}")


def build_mode(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | OptimizerFactory,
               scheduler: torch.optim.lr_scheduler.LRScheduler | SchedulerFactory | None,
               diloco: DiLoCoConfig | None, config: CollaborationConfig) -> TrainingMode:
    """The training mode `Optimizer` runs for these settings (also built by each local rank of a
    `torchrun` peer, `swarm.optim.distributed`, so every rank holds the same one)."""
    torch_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(params)
    torch_scheduler = scheduler(torch_optimizer) if callable(scheduler) and not isinstance(
        scheduler, torch.optim.lr_scheduler.LRScheduler) else scheduler
    if diloco is not None:
        return DiLoCoMode(params, torch_optimizer, torch_scheduler, diloco)
    return LargeBatchMode(params, torch_optimizer, torch_scheduler, trial_step=config.trial_step)


@dataclass
class _InFlight:
    """A round averaging on the peer's loop while the trainer computes."""

    epoch: int
    samples: int
    opened_at: int  # the epoch of the parameters its oldest gradients were computed on
    started: float
    expected: int  # peers the progress records said would join
    averager: AveragerLike
    future: concurrent.futures.Future[RoundResult | None]


class Optimizer:
    """A torch optimizer shared by a swarm of peers.

    Example::

        opt = swarm.Optimizer(peer, run_id="my-run", params=model.parameters(),
                              optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
                              target_batch_size=4096, batch_size_per_step=32)
        for x, y in data:
            loss_fn(model(x), y).backward()
            opt.step()           # accumulates; takes the collective step when the swarm is ready
            opt.zero_grad()

    Args:
        peer: the `swarm.Peer` this trainer runs in (its DHT must be running).
        run_id: the run's name; peers with the same run_id train together.
        params: the dense parameters to train (experts train on their servers).
        optimizer: a torch optimizer over `params`, or a factory `params -> optimizer`.
            In DiLoCo mode it is the inner optimizer.
        target_batch_size: samples the swarm accumulates per collective step (large-batch mode).
        batch_size_per_step: samples per `step()` call when `step` is not told.
        scheduler: an LR scheduler of `optimizer`, or a factory `optimizer -> scheduler`; stepped
            once per collective step (large-batch) or per inner step (DiLoCo).
        diloco: switch to DiLoCo mode with these settings.
        config: collaboration settings; `target_batch_size` overrides its field of that name.
        averager_factory: builds the averager of a tensor list under a DHT prefix; by default a
            `swarm.Averager` of this peer (replace it to use another group-forming strategy).
        mode_wrapper: wraps the mode built from these settings (`swarm.optim.distributed` puts a
            `torchrun` job's local ranks behind it, so the machine is one peer).
        checkpoint_dir: save the run's state there after every collective step (the last 3 kept);
            `checkpoint` sets the schedule instead (`swarm.optim.checkpointing`).
        checkpoint: where and how often to save the run's state.
        resume_from: a directory of the run's checkpoints, an archiver's multiaddr with its
            PeerID, or archivers' PeerIDs (comma-separated; found through their DHT announcements):
            when no live peer holds a newer state, this trainer starts from the newest checkpoint
            that verifies, or from the state those archivers serve (a cold restart).

    Raises:
        ConfigError: inconsistent settings (no target batch in large-batch mode, ...).
    """

    def __init__(
        self,
        peer: PeerHandle,
        run_id: str,
        params: Iterable[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        target_batch_size: int | None = None,
        **options: Unpack[OptimizerOptions],
    ) -> None:
        if not isinstance(run_id, str) or not run_id or any(c.isspace() for c in run_id):
            raise ConfigError(f"run_id must be a non-empty string without spaces, got {run_id!r}")
        check_options(options, "swarm.Optimizer")
        batch_size_per_step, scheduler, diloco = (
            options.get("batch_size_per_step"), options.get("scheduler"), options.get("diloco"))
        averager_factory, mode_wrapper = options.get("averager_factory"), options.get("mode_wrapper")
        checkpoint_dir, checkpoint, resume_from = (
            options.get("checkpoint_dir"), options.get("checkpoint"), options.get("resume_from"))
        config = options.get("config") or CollaborationConfig()
        if target_batch_size is not None:
            config = replace(config, target_batch_size=target_batch_size)
        if diloco is None and config.target_batch_size is None:
            raise ConfigError("large-batch mode needs target_batch_size (or pass diloco=DiLoCoConfig())")
        if batch_size_per_step is not None and batch_size_per_step < 1:
            raise ConfigError(f"batch_size_per_step must be positive, got {batch_size_per_step}")
        if peer.dht is None:
            raise ConfigError("swarm.Optimizer needs a peer whose DHT is running")
        self.peer = peer
        self.run_id = run_id
        self.config = config
        self.batch_size_per_step = batch_size_per_step
        self.params = [p for p in params]
        if not self.params or any(not isinstance(p, torch.Tensor) for p in self.params):
            raise ConfigError("params must be a non-empty iterable of tensors")
        mode = build_mode(self.params, optimizer, scheduler, diloco, config)
        self.mode: TrainingMode = mode_wrapper(mode) if mode_wrapper is not None else mode
        compression = diloco.compression if diloco is not None else config.gradient_compression
        prefix = f"{run_id}.{'outer' if diloco is not None else 'grads'}"
        factory = averager_factory or (
            lambda tensors, key: make_swarm_averager(peer, tensors, key, config, compression))
        fragments = self.mode.averaged_fragments
        # one averager per fragment (DiLoCo's streaming mode), each under its own prefix
        self.averagers: list[AveragerLike] = [
            factory(tensors, prefix if len(fragments) == 1 else f"{prefix}.f{i}") for i, tensors in enumerate(fragments)]
        self.idle_seconds = 0.0
        self._in_flight: _InFlight | None = None
        self._window_opened = 0  # the epoch of the parameters the current window's first batch saw
        self.epoch = 0
        self.samples_total = 0
        self.failed_rounds = 0
        self.bytes_sent = 0
        self.history: list[RoundOutcome] = []
        self._lock = threading.Lock()  # held while parameters or optimizer state change
        self._meter = ThroughputMeter()
        self._digest = state_digest(self.mode.shared_tensors)
        self._resync_not_before = 0.0
        self._announced_epoch = -1  # the last epoch whose round this peer announced it will join
        self._holding = False  # waiting for a near target (`_wait_for_target`)
        self._closed = False
        # the last epoch whose round landed, failed or was dropped, and its change (`_served_snapshot`)
        self._settled_epoch = -1
        self._settled = threading.Condition()
        self._batch_seconds = 0.0  # the last batch's time at the measured pace (0: not measured yet)
        # the mean applied by the round leading out of this epoch, kept for a peer its group left
        # out (`_catch_up`); replaced by the next round that lands
        self._kept_result: tuple[int, list[torch.Tensor]] | None = None
        addr = peer.addrs[0] if peer.addrs and not peer.client_mode else ""
        self.tracker = ProgressTracker(peer, run_id, config, addr=addr)
        self._report()
        self._state_server = serve_state(peer, run_id, self._served_snapshot) if peer.server is not None else None
        self._result_server = serve_round_result(peer, run_id, lambda: self._kept_result) if (
            peer.server is not None and self.mode.catches_up) else None
        self.peer.run(self.tracker.astart())
        peer.attach(self)
        if config.load_state_on_start and self.tracker.peers_at(0):
            self.load_state_from_peers()
        if checkpoint is None and checkpoint_dir is not None:
            checkpoint = CheckpointConfig(checkpoint_dir)
        self.checkpointer = Checkpointer(checkpoint, run_id, self.params) if checkpoint is not None else None
        if resume_from is not None:
            self._resume(str(resume_from))
        self._report(urgent=True)

    # -- the training loop's calls ------------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer (the inner one in DiLoCo mode)."""
        return self.mode.optimizer

    @property
    def shared_tensors(self) -> list[torch.Tensor]:
        """What every peer at `epoch` holds alike: the parameters (large-batch mode; while a
        trial step moved the parameters for the round in flight, the ones it moved them from,
        `CollaborationConfig.trial_step`), or DiLoCo's outer parameters. Checkpoints and
        comparisons between peers read these; `flush()` first lands the round in flight."""
        return self.mode.shared_tensors

    @property
    def averager(self) -> AveragerLike:
        """The averager of the (first) fragment."""
        return self.averagers[0]

    @property
    def progress(self) -> SwarmProgress:
        """Where the swarm stands: global epoch, samples towards the next step, peers, throughput."""
        return self.tracker.progress

    def wait_for_peers(self, count: int, timeout: float) -> bool:
        """Blocks until at least `count` peers (this one included) report progress; False on timeout."""
        return self.tracker.wait_for(lambda p: p.num_peers >= count, timeout)

    def step(self, batch_size: int | None = None) -> StepOutcome:
        """Takes in one local batch (its gradients are in `param.grad`); may take a collective step.

        Args:
            batch_size: samples in the batch whose gradients were just computed
                (default: `batch_size_per_step`).

        Returns:
            What the call did: the round it ran, a state download, discarded samples.
        """
        if self._closed:
            raise SwarmError("this optimizer was shut down")
        batch_size = batch_size or self.batch_size_per_step
        if not batch_size or batch_size < 1:
            raise ValueError("pass batch_size to step() or batch_size_per_step to the constructor")
        computed_at = self.epoch  # the parameters this batch's gradients were computed on
        caught_up: int | None = None  # samples dropped by catching up with a missed round
        if self._in_flight is None and time.monotonic() >= self._resync_not_before:
            progress = self.tracker.progress
            if progress.epoch > self.epoch:
                behind = f"this peer is at epoch {self.epoch}, the swarm at {progress.epoch}"
                caught_up = self._catch_up(progress.epoch)
                if caught_up is None:
                    return self._resync(behind, min_epoch=progress.epoch)
                if self.epoch - computed_at > self.config.max_staleness:
                    # every round waited for: a batch computed before the missed round is too old
                    return StepOutcome(self.epoch, caught_up=True, discarded_samples=caught_up)
            else:
                canonical = canonical_digest(self.tracker.reports(), self.epoch)
                if canonical is not None and canonical != self._digest:
                    return self._resync(f"peers at epoch {self.epoch} hold different states",
                                        min_epoch=self.epoch, digest=canonical)
        outcome = self._take_batch(batch_size, computed_at)
        if caught_up is None:
            return outcome
        return replace(outcome, caught_up=True, discarded_samples=outcome.discarded_samples + caught_up)

    def _take_batch(self, batch_size: int, computed_at: int) -> StepOutcome:
        """The rest of `step`: takes the batch in, lands the round that arrived, launches the next."""
        with self._lock:
            if self.mode.samples == 0:
                self._window_opened = computed_at
            self.mode.on_batch(batch_size)
        self.samples_total += batch_size
        if self._meter.update(batch_size, time.monotonic()) > 0:
            self._batch_seconds = batch_size / self._meter.rate
        self._report()
        landed = None
        if self._in_flight is not None and self._in_flight.future.done():
            landed = self._land(wait=False)
            if not landed.ok and self.tracker.progress.epoch > self.epoch:
                return self._after_failure(landed)
        progress = self._next_round_progress()
        if not self.mode.wants_round(progress) and (bound := self._near_target_wait(progress)):
            progress = self._wait_for_target(bound)
        if not self.mode.wants_round(progress):
            self._announce_round(progress)
            return StepOutcome(self.epoch, round=landed)
        if self._in_flight is not None:
            # the next round is due before this one ended: wait for it (the staleness bound)
            landed = self._land(wait=True)
            if not landed.ok and self.tracker.progress.epoch > self.epoch:
                return self._after_failure(landed)
            progress = self.tracker.progress
            if not self.mode.wants_round(progress):
                self._announce_round(progress)
                return StepOutcome(self.epoch, round=landed)
        launched = self.epoch
        alone = self._launch(progress)
        if alone is not None:
            return StepOutcome(self.epoch, round=alone)
        if self.config.max_staleness == 0:
            self._report(urgent=True)  # it stops computing: say so before the others extrapolate it
            landed = self._land(wait=True)
            if not landed.ok and self.tracker.progress.epoch > self.epoch:
                return self._after_failure(landed)
            return StepOutcome(self.epoch, round=landed)
        if self.mode.paced_alone:
            self._announce_round(self._next_round_progress())
        return StepOutcome(self.epoch, round=landed, launched=launched)

    def _after_failure(self, outcome: RoundOutcome) -> StepOutcome:
        swarm_epoch = self.tracker.progress.epoch
        discarded = self._catch_up(swarm_epoch)
        if discarded is not None:
            return StepOutcome(self.epoch, round=outcome, caught_up=True, discarded_samples=discarded)
        resynced = self._resync(f"the swarm moved on to epoch {swarm_epoch}", min_epoch=swarm_epoch)
        return replace(resynced, round=outcome)

    def flush(self) -> RoundOutcome | None:
        """Waits for the round in flight, if any, and applies it (before a checkpoint or an
        evaluation that should see every round, or at the end of training); returns its outcome."""
        if self._in_flight is None:
            return None
        return self._land(wait=True)

    async def astep(self, batch_size: int | None = None) -> StepOutcome:
        """Awaitable `step` for code inside an event loop (runs it in a worker thread)."""
        return await asyncio.to_thread(self.step, batch_size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of the wrapped parameters."""
        self.mode.optimizer.zero_grad(set_to_none=set_to_none)

    def load_state_from_peers(self, min_epoch: int = 0, digest: str | None = None) -> bool:
        """Downloads the newest training state from other peers; returns False if none delivered it.

        Args:
            min_epoch: refuse older states.
            digest: only download from peers whose state has this fingerprint.
        """
        started = time.monotonic()
        self._drop_in_flight()
        candidates = [c for c in self.tracker.peers_at(min_epoch) if digest is None or c.digest == digest]
        download_started = time.monotonic()
        try:
            state = self.peer.run(download_state(self.peer, self.run_id, candidates, self.config.state_timeout,
                                                 min_epoch), timeout=self.config.state_timeout + 5)
        except (StateTransferError, TimeoutError) as e:
            logger.warning("[%s] %s", self.run_id, e)
            return False
        downloaded = time.monotonic()
        with self._lock:
            self.mode.load_state(state)
            self._kept_result = None
            previous, self.epoch = self.epoch, state.epoch
            self._digest = state_digest(self.mode.shared_tensors)
        self._meter.resume(time.monotonic())
        logger.info("[%s] loaded the swarm's state: epoch %d (was %d) in %.2f s (the round in flight dropped in "
                    "%.2f s, the download %.2f s)", self.run_id, state.epoch, previous, time.monotonic() - started,
                    download_started - started, downloaded - download_started)
        self._report(urgent=True)
        return True

    async def aload_state_from_peers(self, min_epoch: int = 0, digest: str | None = None) -> bool:
        """Awaitable `load_state_from_peers` (runs it in a worker thread)."""
        return await asyncio.to_thread(self.load_state_from_peers, min_epoch, digest)

    # -- rounds -------------------------------------------------------------------------------

    def _launch(self, progress: SwarmProgress) -> RoundOutcome | None:
        """Starts the round of this epoch on the peer's loop; a lone peer steps at once (returned)."""
        epoch, samples = self.epoch, self.mode.samples
        staleness = epoch - self._window_opened
        started = time.monotonic()
        if progress.num_peers == 1:
            # nobody else reports progress: this peer's mean is the swarm's mean
            with self._lock:
                self.mode.prepare_round(epoch)
                self.mode.step_alone(epoch)
            outcome = RoundOutcome(epoch, True, 1, 1, samples, time.monotonic() - started, staleness=staleness)
            return self._finish_round(outcome, f"stepped alone (no other peer), {samples} samples")
        with self._lock:
            weight = self.mode.prepare_round(epoch)
        averager = self.averagers[self.mode.fragment_of(epoch)]
        future = self.peer.loop.submit(self._average(averager, epoch, weight, progress.num_peers))
        self._in_flight = _InFlight(epoch, samples, self._window_opened, started, progress.num_peers, averager,
                                    future)
        if self.config.max_staleness > 0:
            with self._lock:
                self.mode.overlap(epoch)  # the trainer computes on while the round averages
        return None

    def _land(self, wait: bool) -> RoundOutcome:
        """Applies the round in flight (waiting for it first if `wait`), or takes its failure."""
        flight = self._in_flight
        assert flight is not None
        what = "pseudo-gradients" if self.mode.name == "diloco" else "gradients"
        fragment = f" (fragment {self.mode.fragment_of(flight.epoch)})" if len(self.averagers) > 1 else ""
        staleness = self.epoch - flight.opened_at
        waited = time.monotonic()
        error: str | None = None
        try:
            result = flight.future.result(timeout=self.config.averaging_timeout + 5.0 if wait else 0.0)
        except (SwarmError, TimeoutError, concurrent.futures.CancelledError) as e:
            flight.future.cancel()
            result, error = None, f"{type(e).__name__}: {e}"
        finally:
            self._in_flight = None
            if wait:
                self.idle_seconds += time.monotonic() - waited
                self._meter.resume(time.monotonic())
        seconds = time.monotonic() - flight.started
        if error is not None:
            with self._lock:
                if self.mode.samples == 0:
                    self._window_opened = flight.opened_at
                self._window_opened = min(self._window_opened, flight.opened_at)
                self.mode.abort_round(flight.epoch)
            outcome = RoundOutcome(flight.epoch, False, 0, 0, flight.samples, seconds, error, staleness)
            return self._finish_round(outcome, "")
        if result is None:
            with self._lock:
                self.mode.step_alone(flight.epoch)
            outcome = RoundOutcome(flight.epoch, True, 1, 1, flight.samples, seconds, staleness=staleness)
            return self._finish_round(outcome, f"the other peers left during the round: stepped alone, "
                                               f"{flight.samples} local samples")
        with self._lock:
            self.mode.apply_round(flight.epoch)
            # a peer the round expected was left out: it may catch up from this mean (`_catch_up`)
            self._kept_result = (flight.epoch, [t.clone() for t in self.mode.round_result()]) if (
                result.contributors < flight.expected) else None
        self.bytes_sent += result.bytes_sent
        outcome = RoundOutcome(flight.epoch, True, result.group_size, result.contributors, flight.samples, seconds,
                               staleness=staleness)
        return self._finish_round(outcome, f"averaged {what}{fragment} of {result.contributors}/{result.group_size} "
                                           f"peers, {flight.samples} local samples, staleness {staleness}")

    def _drop_in_flight(self) -> None:
        """Cancels the round in flight (this peer leaves, or loads another state) and waits for its end."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        flight.future.cancel()
        try:
            flight.future.result(timeout=5.0)
        except (SwarmError, TimeoutError, concurrent.futures.CancelledError):
            pass
        with self._lock:
            self.mode.abort_round(flight.epoch)
        self._settle(flight.epoch)

    def _settle(self, epoch: int) -> None:
        """Records that the round of `epoch` is over (landed, failed or dropped) for a state request
        waiting for it."""
        with self._settled:
            self._settled_epoch = max(self._settled_epoch, epoch)
            self._settled.notify_all()

    def _near_target_wait(self, progress: SwarmProgress) -> float:
        """Seconds to wait for the target instead of computing the next batch: `NEAR_TARGET` of the
        batch's time when every round is waited for and the swarm's reports say the target comes
        within it (the batch would make the round wait for this peer); 0 otherwise."""
        if self.config.max_staleness != 0 or self._in_flight is not None or progress.target_batch_size is None:
            return 0.0
        bound = NEAR_TARGET * self._batch_seconds
        return bound if progress.eta <= bound else 0.0

    def _wait_for_target(self, bound: float) -> SwarmProgress:
        """Waits, at most `bound` seconds, for the reports to reach the target (saying meanwhile
        that this peer computes nothing, so no one counts samples it does not make); returns the
        progress then. Counted in `idle_seconds`."""
        waited = time.monotonic()
        self._holding = True
        self._report(urgent=True)
        try:
            self.tracker.wait_for(lambda p: p.ready or p.epoch > self.epoch, bound)
        finally:
            self._holding = False
            self.idle_seconds += time.monotonic() - waited
            self._meter.resume(time.monotonic())
        return self.tracker.progress

    def _next_round_progress(self) -> SwarmProgress:
        """The swarm's progress towards the next round this peer would start."""
        if self._in_flight is None:
            return self.tracker.progress
        return self.tracker.progress_ahead(self._in_flight.epoch)

    async def _average(self, averager: AveragerLike, epoch: int, weight: float,
                       expected_size: int) -> RoundResult | None:
        """Runs the averaging round; returns None if every other peer leaves before it ends.

        While the round still looks for a group it also stops when the swarm moves past this
        epoch (another peer stepped without this one: its group would never form), raising
        `AveragingError` at once instead of waiting out the timeout; the step then downloads the
        swarm's state.
        """
        round_task = asyncio.ensure_future(averager.astep(
            weight=weight, timeout=self.config.averaging_timeout, expected_size=expected_size,
            group_key=str(epoch)))
        watch_epoch = True
        try:
            while True:
                moved_on = epoch if watch_epoch else None

                def alone_or_moved_on(p: SwarmProgress, moved_on: int | None = moved_on) -> bool:
                    return p.num_peers == 1 or (moved_on is not None and p.epoch > moved_on)

                watch = asyncio.ensure_future(self.tracker.wait_until(alone_or_moved_on))
                try:
                    await asyncio.wait({round_task, watch}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    watch.cancel()
                if round_task.done():
                    return round_task.result()
                progress = watch.result()
                if progress.num_peers == 1:
                    # nobody is left to average with (a lone peer forms no group): stop waiting for one
                    round_task.cancel()
                    await asyncio.gather(round_task, return_exceptions=True)
                    return None
                if averager.abandon_matchmaking(f"the swarm moved on to epoch {progress.epoch}"):
                    return await round_task  # raises the AveragingError that names why
                watch_epoch = False  # the group formed: its members count on this peer, finish the round
        finally:
            if not round_task.done():
                round_task.cancel()

    def _announce_round(self, progress: SwarmProgress) -> None:
        """Once its next round is near, tells the round's leader when this peer will come.

        In large-batch mode "near" is the horizon within which a leader would otherwise start
        without us: a few progress reports, or many measured round trips, whichever is longer (the
        measurement counts on slow links), and never beyond half the averaging timeout. In DiLoCo
        mode a peer's round is due after its own H inner steps, and with rounds overlapped nothing
        keeps the peers in step: a slower one reaches each round later than the others, by more
        every round, until a group forms without it and it downloads the state, dropping its inner
        steps. So it announces the round as soon as its pace says when (right after launching the
        previous one, while the others still wait for that one to land), up to half the timeout
        ahead and `PACE_SLACK` later than the pace says, and the leader waits for it. Runs in the background: the step does not wait for the DHT.
        """
        epoch = self.epoch + (1 if self._in_flight is not None else 0)  # the next round this peer starts
        averager = self.averagers[self.mode.fragment_of(epoch)]
        eta = self.mode.eta(progress, self._meter.rate)
        if self._announced_epoch == epoch or not math.isfinite(eta):
            return
        rtt = averager.round_trip()
        horizon = self.config.averaging_timeout / 2
        if not self.mode.paced_alone:
            horizon = min(horizon, max(2 * self.config.report_period, 50 * (rtt or 0.0)))
        if eta > horizon:
            return
        if self.mode.paced_alone:
            eta *= 1 + PACE_SLACK
        self._announced_epoch = epoch
        logger.debug("[%s] epoch %d: announcing this peer for the round in %.2f s (horizon %.2f s, rtt %s)",
                     self.run_id, epoch, eta, horizon, f"{rtt:.4f}" if rtt is not None else "unknown")
        future = self.peer.loop.submit(averager.aannounce(eta, str(epoch)))
        future.add_done_callback(_log_announce_failure)

    def _finish_round(self, outcome: RoundOutcome, summary: str) -> RoundOutcome:
        """Records the round and logs its outcome once."""
        if outcome.ok:
            with self._lock:
                self.epoch += 1
                self._digest = state_digest(self.mode.shared_tensors)
            self.failed_rounds = 0
            logger.info("[%s] epoch %d -> %d: %s in %.2f s", self.run_id, outcome.epoch, self.epoch, summary,
                        outcome.seconds)
            if self.checkpointer is not None and self.checkpointer.due(self.epoch):
                self.checkpointer.save(self._snapshot(), self.samples_total)
        elif self.tracker.progress.epoch > outcome.epoch:
            # not a fault: the swarm stepped without this peer, which now downloads its state
            logger.info("[%s] epoch %d: the swarm moved on to epoch %d during this peer's round (%s)",
                        self.run_id, outcome.epoch, self.tracker.progress.epoch, outcome.error)
        else:
            self.failed_rounds += 1
            # every member of the group got this same error, so every member keeps its
            # accumulated work and retries at its next step
            logger.warning("[%s] epoch %d: averaging failed after %.1f s (%s); keeping the %d local samples "
                           "and retrying (failure %d in a row)", self.run_id, outcome.epoch, outcome.seconds,
                           outcome.error, outcome.samples, self.failed_rounds)
            if self.failed_rounds >= self.config.max_failed_rounds:
                self.tracker.request_refresh()  # the swarm may have moved on without us
        self.history.append(outcome)
        self.tracker.report_round(outcome)  # in the next progress report, for people watching (dashboard)
        self._settle(outcome.epoch)
        self._report(urgent=True)
        return outcome

    def _resync(self, why: str, min_epoch: int, digest: str | None = None) -> StepOutcome:
        with self._lock:
            discarded = self.mode.discard()
        logger.info("[%s] %s: downloading the swarm's state (%d local samples dropped)", self.run_id, why,
                    discarded)
        loaded = self.load_state_from_peers(min_epoch=min_epoch, digest=digest)
        if not loaded:
            # keep training where we are for a while rather than asking on every step
            self._resync_not_before = time.monotonic() + self.config.max_refresh_period
            self.tracker.request_refresh()
        return StepOutcome(self.epoch, state_loaded=loaded, discarded_samples=discarded)

    def _catch_up(self, swarm_epoch: int) -> int | None:
        """Takes the step of the one round this peer missed (the swarm is one epoch ahead) from that
        round's result, downloaded from a member that keeps it, and checks the state it reaches
        against the fingerprint most peers at the new epoch report. Local samples too old for the
        staleness bound at the new epoch are dropped; the rest go into the next round (they are not
        in the missed round's mean). Returns the samples dropped, or None when it did not catch up
        (the mode cannot, the swarm is further ahead, no member delivered a result, or the check
        failed): the caller then downloads the state, which replaces whatever this step changed."""
        if not self.mode.catches_up or self._in_flight is not None or swarm_epoch != self.epoch + 1:
            return None
        missed = self.epoch
        candidates = [c for c in self.tracker.peers_at(swarm_epoch) if c.epoch == swarm_epoch]
        if not candidates:
            return None
        started = time.monotonic()
        timeout = min(self.config.state_timeout, self.config.averaging_timeout)
        try:
            result, source = self.peer.run(download_round_result(
                self.peer, self.run_id, candidates, missed, self.mode.round_result(), timeout), timeout=timeout + 5)
        except (StateTransferError, TimeoutError) as e:
            logger.info("[%s] epoch %d: not catching up from the missed round's result (%s)", self.run_id, missed, e)
            return None
        with self._lock:
            self.mode.apply_result(result)
            self.epoch = swarm_epoch
            self._digest = state_digest(self.mode.shared_tensors)
            stale = self.mode.samples > 0 and self.epoch - self._window_opened > self.config.max_staleness
            discarded = self.mode.discard() if stale else 0
        self._meter.resume(time.monotonic())
        expected = majority_digest(self.tracker.peers_at(swarm_epoch), swarm_epoch)
        if expected is not None and expected != self._digest:
            logger.warning("[%s] the result of round %d from %s gives a state the peers at epoch %d do not hold",
                           self.run_id, missed, source[-8:], swarm_epoch)
            return None
        mbytes = sum(t.numel() * t.element_size() for t in result) / 1e6
        logger.info("[%s] epoch %d -> %d: caught up with the round this peer missed from its result (%.1f MB from "
                    "%s in %.2f s), %d local samples kept, %d dropped", self.run_id, missed, self.epoch, mbytes,
                    source[-8:], time.monotonic() - started, self.mode.samples, discarded)
        self._report(urgent=True)
        return discarded

    # -- helpers ------------------------------------------------------------------------------

    def _report(self, urgent: bool = False) -> None:
        waited_for = self._in_flight if self.config.max_staleness == 0 else None  # the round it waits for
        samples = waited_for.samples if waited_for is not None else self.mode.samples
        # a peer waiting for its round, or for a near target (`_wait_for_target`), computes nothing
        # until the wait ends: it reports its samples at no throughput, so the others do not
        # extrapolate samples it never computes (summarize) and start a round short of the target
        rate = 0.0 if waited_for is not None or self._holding else self._meter.rate
        self.tracker.update(self.epoch, samples, rate, self._digest, urgent=urgent)

    def _snapshot(self) -> TrainingState:
        with self._lock:
            return self.mode.state(self.epoch).clone()

    def _served_snapshot(self) -> TrainingState:
        """The state served to a peer that downloads it (in a worker thread of the loop): with a round
        in flight, the state once that round has landed (`LAND_WAIT_BATCHES`)."""
        flight = self._in_flight
        if flight is not None and not self._closed:
            logger.debug("[%s] state asked for while round %d is in flight: serving it once the round lands",
                         self.run_id, flight.epoch)
            try:  # the averaging's end: it fails by its deadline at the latest
                flight.future.exception(timeout=self.config.averaging_timeout)
            except (concurrent.futures.CancelledError, TimeoutError):
                pass
            land_wait = max(LAND_WAIT_MIN, LAND_WAIT_BATCHES * self._batch_seconds)
            with self._settled:
                self._settled.wait_for(lambda: self._settled_epoch >= flight.epoch or self._closed, land_wait)
        return self._snapshot()

    def state_dict(self) -> dict[str, Any]:
        """The epoch, mode state and optimizer state, for a local checkpoint."""
        tensors, metadata = self._snapshot().to_wire()
        return {"tensors": tensors, "metadata": metadata}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loaded = TrainingState.from_wire(state["tensors"], state["metadata"])
        self._drop_in_flight()
        with self._lock:
            self.mode.load_state(loaded)
            self.epoch = loaded.epoch
            self._digest = state_digest(self.mode.shared_tensors)
        self._report(urgent=True)

    def save_checkpoint(self) -> Path | None:
        """Saves the state now (after landing the round in flight) and waits until it is written;
        returns its directory, or None when it failed (logged; `checkpointer.last_error` says why)."""
        if self.checkpointer is None:
            raise ConfigError("this optimizer has no checkpoint directory")
        self.flush()
        self.checkpointer.save(self._snapshot(), self.samples_total, wait=True)
        return self.checkpointer.last_saved if self.checkpointer.last_error is None else None

    def _resume(self, source: str) -> None:
        """A cold restart: loads the newest checkpoint in the directory `source`, or the state the
        archiver at multiaddr `source` (or the archivers whose PeerIDs `source` lists, found in
        the DHT) serves, unless this trainer already holds a state at least as far (the live
        peers', downloaded before this)."""
        # newer than what this trainer holds: a live peer's state, when its download succeeded, is
        # held already; a progress record whose peer is gone (its download failed) counts for nothing
        state = load_cold_state(self.peer, self.run_id, source, self.params, self.checkpointer, self.epoch + 1,
                                self.tracker.reports(), self.config.state_timeout)
        if state is None:
            return
        with self._lock:
            self.mode.load_state(state)
            self.epoch = state.epoch
            self._digest = state_digest(self.mode.shared_tensors)

    async def ashutdown(self) -> None:
        """Stops reporting and serving state (called by the peer at shutdown, or directly)."""
        if self._closed:
            return
        self._closed = True
        with self._settled:
            self._settled.notify_all()  # a state request waiting for a round serves what is held
        if self._in_flight is not None:
            self._in_flight.future.cancel()
        for server in (self._state_server, self._result_server):
            if server is not None:
                await server.ashutdown()
                self.peer.detach(server)
        await self.tracker.ashutdown()
        for averager in self.averagers:
            try:
                await averager.ashutdown()
            except (SwarmError, RPCError, OSError):
                logger.debug("averager shutdown failed", exc_info=True)

    def shutdown(self) -> None:
        """Leaves the run: withdraws this peer's progress record and stops serving its state."""
        if not self._closed and not self.peer.loop.loop.is_closed():
            self._drop_in_flight()
            self.peer.run(self.ashutdown(), timeout=10)
        if self.checkpointer is not None:
            self.checkpointer.wait()  # a save being written finishes: it is the newest state
        self.peer.detach(self)

    def __repr__(self) -> str:
        return f"swarm.Optimizer(run_id={self.run_id!r}, mode={self.mode.name}, epoch={self.epoch})"


__all__ = ["Optimizer"]


def _log_announce_failure(future: concurrent.futures.Future[bool]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.debug("announcing the next round failed: %s", future.exception())
