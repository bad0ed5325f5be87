"""Training progress: what each peer reports in the DHT, and what the swarm's reports add up to.

Pure logic, no networking. Every peer stores one record under `<run_id>.progress`, subkey =
its `swarm.dht.owner_marker` (so DHT nodes store it only with that peer's signature, and no one
else can overwrite or forge it; readers ignore other subkeys): its epoch, the samples it accumulated towards the next step, its throughput and
the time of the report. Any peer reading the dictionary can then tell the global epoch (the
highest any live peer reached), how many samples the swarm holds towards the next step, and
when it expects the target batch to be reached, so it reads the DHT again at that moment
instead of polling (the same estimate drives hivemind's ProgressTracker).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from swarm.optim.outcome import RoundOutcome


def progress_key(run_id: str) -> str:
    """The DHT key under which the peers of a run report their progress (subkey: the reporter's
    `owner_marker`, so only it can write its report)."""
    return f"{run_id}.progress"


@dataclass(frozen=True)
class RoundSummary:
    """A peer's last collective step as its progress record carries it, for people watching the run.

    Attributes:
        epoch: the epoch the round led out of.
        ok: it averaged and the step was applied.
        group_size: members of its group (1: the peer stepped alone; 0: it failed before one formed).
        contributors: members whose tensors are in the mean (fewer than the group: some failed, or
            robust aggregation excluded them).
        seconds: its wall time.
    """

    epoch: int
    ok: bool
    group_size: int
    contributors: int
    seconds: float

    @classmethod
    def of(cls, outcome: RoundOutcome) -> RoundSummary:
        return cls(outcome.epoch, outcome.ok, outcome.group_size, outcome.contributors, float(outcome.seconds))

    def to_record(self) -> list[int | bool | float]:
        return [self.epoch, self.ok, self.group_size, self.contributors, self.seconds]

    @classmethod
    def from_record(cls, record: object) -> RoundSummary | None:
        """None for anything but ``[epoch, ok, group_size, contributors, seconds]`` with sane values."""
        if not isinstance(record, (list, tuple)) or len(record) != 5:
            return None
        epoch, ok, group, contributors, seconds = record
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, group, contributors)):
            return None
        if not isinstance(ok, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < 1e9:
            return None
        return cls(epoch, ok, group, min(contributors, group), float(seconds))


@dataclass(frozen=True)
class PeerProgress:
    """One peer's report.

    Attributes:
        peer_id: who reports.
        epoch: the number of collective steps this peer has taken (or loaded).
        samples: samples accumulated towards the step that leads out of `epoch`.
        samples_per_second: this peer's recent training throughput.
        time: wall-clock time of the report (DHT time).
        client_mode: the peer only dials out (it can average, but serves no state).
        addr: a multiaddr others can download this peer's state from ("" in client mode).
        digest: a fingerprint of the state this peer holds at `epoch`; peers at one epoch must
            agree on it (`canonical_digest`).
        loss: the training loss the trainer last reported (`ProgressTracker.report_loss`), for
            people watching the run (the dashboard); None where it reports none. Nothing in
            training reads it.
        target_batch_size: the target batch this peer trains towards (None: no target, DiLoCo;
            or an older peer), for people watching the run.
        last_round: this peer's last collective step (`ProgressTracker.report_round`), for people
            watching the run; None before its first or from an older peer.
    """

    peer_id: str
    epoch: int
    samples: int
    samples_per_second: float
    time: float
    client_mode: bool = False
    addr: str = ""
    digest: str = ""
    loss: float | None = None
    target_batch_size: int | None = None
    last_round: RoundSummary | None = None

    def to_record(self) -> dict[str, object]:
        """The msgpack-able value stored in the DHT (the subkey names the PeerID)."""
        record: dict[str, object] = {
            "epoch": self.epoch, "samples": self.samples, "sps": float(self.samples_per_second),
            "time": float(self.time), "client": self.client_mode, "addr": self.addr, "digest": self.digest,
        }
        if self.loss is not None:
            record["loss"] = float(self.loss)  # optional: readers of older versions ignore it
        if self.target_batch_size is not None:
            record["target"] = self.target_batch_size
        if self.last_round is not None:
            record["round"] = self.last_round.to_record()
        return record

    @classmethod
    def from_record(cls, peer_id: str, record: object) -> PeerProgress | None:
        """Parses a stored record; returns None for anything malformed (a foreign or hostile value)."""
        if not isinstance(peer_id, str) or not isinstance(record, Mapping):
            return None
        try:
            epoch, samples = record["epoch"], record["samples"]
            sps, time = float(record["sps"]), float(record["time"])
            client = bool(record.get("client", False))
            addr = record.get("addr", "")
            digest = record.get("digest", "")
            raw_loss = record.get("loss")
            loss = None if raw_loss is None else float(raw_loss)
            target = record.get("target")
            last_round = RoundSummary.from_record(record.get("round"))  # None when absent or malformed
        except (KeyError, TypeError, ValueError):
            return None
        if not isinstance(epoch, int) or not isinstance(samples, int) or epoch < 0 or samples < 0:
            return None
        if not (math.isfinite(sps) and math.isfinite(time)) or sps < 0 or not isinstance(addr, str):
            return None
        if not isinstance(digest, str):
            return None
        if loss is not None and not math.isfinite(loss):
            loss = None  # a NaN/Inf loss is no figure to show; the report itself still counts
        if target is not None and (not isinstance(target, int) or isinstance(target, bool) or target < 1):
            target = None
        return cls(peer_id, epoch, samples, sps, time, client, addr, digest, loss, target, last_round)


@dataclass(frozen=True)
class SwarmProgress:
    """What the reports of all live peers add up to, as seen by one peer at `now`.

    Attributes:
        epoch: the global epoch: the highest epoch any live peer reports.
        samples: samples reported towards the next step by peers at `epoch`.
        estimated_samples: `samples` plus what those peers have probably processed since
            their reports (throughput times age), the figure compared with the target.
        target_batch_size: the target, when the mode has one.
        num_peers: live peers, at any epoch.
        num_peers_at_epoch: live peers at `epoch` (the ones that average together next).
        samples_per_second: the swarm's total throughput.
        eta: seconds until the target is expected to be reached (0 when it is; inf when unknown).
        now: when this was computed.
    """

    epoch: int
    samples: int
    estimated_samples: float
    target_batch_size: int | None
    num_peers: int
    num_peers_at_epoch: int
    samples_per_second: float
    eta: float
    now: float

    @property
    def ready(self) -> bool:
        """True when the swarm holds (or is estimated to hold) the target batch."""
        return self.target_batch_size is not None and self.estimated_samples >= self.target_batch_size


def summarize(
    reports: Iterable[PeerProgress], local: PeerProgress, target_batch_size: int | None, now: float,
    extrapolate_for: float,
) -> SwarmProgress:
    """Adds up the peers' reports (this peer's own fresh progress replaces its stored report).

    Args:
        reports: reports read from the DHT (expired ones are already gone).
        local: this peer's current progress.
        target_batch_size: the target batch, or None (DiLoCo mode).
        now: the current DHT time.
        extrapolate_for: a report younger than this many seconds is extrapolated by its
            throughput; an older one counts as is (its peer may have died).
    """
    by_peer = {r.peer_id: r for r in reports}
    by_peer[local.peer_id] = local
    epoch = max(r.epoch for r in by_peer.values())
    current = [r for r in by_peer.values() if r.epoch == epoch]
    samples = sum(r.samples for r in current)
    estimated = float(samples)
    for r in current:
        age = now - r.time
        if r.peer_id != local.peer_id and 0 < age < extrapolate_for:
            estimated += r.samples_per_second * age
    throughput = sum(r.samples_per_second for r in by_peer.values())
    if target_batch_size is None:
        eta = math.inf
    elif estimated >= target_batch_size:
        eta = 0.0
    elif throughput > 0:
        eta = (target_batch_size - estimated) / throughput
    else:
        eta = math.inf
    return SwarmProgress(
        epoch=epoch, samples=samples, estimated_samples=estimated, target_batch_size=target_batch_size,
        num_peers=len(by_peer), num_peers_at_epoch=len(current), samples_per_second=throughput, eta=eta, now=now,
    )


def canonical_digest(reports: Iterable[PeerProgress], epoch: int) -> str | None:
    """The state fingerprint the peers at `epoch` should converge on, or None if they agree.

    Two groups that stepped apart (they formed at the same time without seeing each other) hold
    different states under one epoch number. The fingerprint held by the most peers wins (ties:
    the smaller string), so every peer picks the same one and the others download it.
    """
    counts = _digest_counts(reports, epoch)
    if len(counts) < 2:
        return None
    return min(counts, key=lambda d: (-counts[d], d))


def majority_digest(reports: Iterable[PeerProgress], epoch: int) -> str | None:
    """The state fingerprint most peers at `epoch` report (ties: the smaller string), or None when
    no report at `epoch` carries one: what a peer that reached `epoch` by itself should hold."""
    counts = _digest_counts(reports, epoch)
    return min(counts, key=lambda d: (-counts[d], d)) if counts else None


def merge_read(
    known: Mapping[str, tuple[PeerProgress, float]], read: Mapping[str, tuple[PeerProgress, float]],
    left: set[str], now: float,
) -> dict[str, tuple[PeerProgress, float]]:
    """What a peer knows of the swarm's reports after one more read of the progress key.

    Args:
        known: PeerID -> (report, its record's expiration) from the reads before.
        read: the same from this read.
        left: PeerIDs whose records in this read say they left.
        now: the current DHT time.

    A read that missed a record (a replica slow to answer, or this node's own copy while it is
    new and empty) does not make its peer leave: the report counts until its record expires,
    unless the peer said it left. The record's expiration decides, not the report's time: a peer
    that waits (for a round, a download, another peer) keeps its record alive with heartbeats
    that repeat its last report, time included. Where both have a report, the newer one counts.
    """
    merged = dict(read)
    for peer_id, (previous, expires) in known.items():
        if peer_id in left:
            continue
        if peer_id not in merged:
            if expires > now:
                merged[peer_id] = (previous, expires)
            continue
        report, read_expires = merged[peer_id]
        merged[peer_id] = (previous if previous.time > report.time else report, max(expires, read_expires))
    return merged


def _digest_counts(reports: Iterable[PeerProgress], epoch: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in reports:
        if r.epoch == epoch and r.digest:
            counts[r.digest] = counts.get(r.digest, 0) + 1
    return counts


class ThroughputMeter:
    """Samples per second over a sliding time constant (an exponential moving average of rates)."""

    def __init__(self, time_constant: float = 10.0) -> None:
        self.time_constant = time_constant
        self.rate = 0.0
        self._last: float | None = None

    def update(self, samples: int, now: float) -> float:
        """Records `samples` processed since the previous update; returns the smoothed rate."""
        if self._last is None:
            self._last = now
            return self.rate
        elapsed = max(now - self._last, 1e-6)
        self._last = now
        instant = samples / elapsed
        alpha = 1.0 - math.exp(-elapsed / self.time_constant)
        self.rate = instant if self.rate == 0.0 else self.rate + alpha * (instant - self.rate)
        return self.rate

    def resume(self, now: float) -> None:
        """Training resumes at `now`: the time since the last update (averaging, waiting,
        downloading) is not counted, and the next update's samples count from `now`. (Forgetting
        the last update instead would count no samples at all of a trainer that waits after
        every batch, and its rate would stay at its first estimate.)"""
        if self._last is not None:
            self._last = now
