"""The swarm's picture as plain data: what the dashboard shows, built from what peers report.

Pure logic, no networking: `build_view` takes the peers' `Info` answers, the training runs'
progress reports (already validated by `swarm.optim.progress.PeerProgress.from_record`) and the
experts' declarations (validated by `swarm.moe.dht_declare`), and returns a dictionary that JSON
can carry to the page. Everything a peer says is kept as text and capped: a string at
`DashboardLimits.max_text` characters, a peer's experts, a run's peers and the whole grid at their
own caps, so one hostile peer can make its own rows wrong but not the page unusable. Nothing
private is in it: a peer's identity is its public PeerID; no key, path or address of the serving
peer's files.

`History` is the serving peer's memory of the last hours (a ring per run and one for the
peer count), so a page opened late still draws curves.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from swarm.optim.progress import PeerProgress, summarize

__all__ = [
    "DashboardLimits", "ExpertDeclaration", "ExpertGrid", "GridCache", "History", "LinkMeasure", "PeerAnswer", "Picture",
    "RunReports", "Snapshot", "build_view", "short_id",
]

Snapshot = dict[str, Any]
"""One snapshot of the page: JSON-able plain data in `build_view`'s layout (the page's contract)."""

_MAX_SAMPLE_POINTS = 4096  # per peer and run: one hour of snapshots at a period of 0.9 s or more
_MAX_ROUNDS = 20  # averaging rounds remembered per run


@dataclass(frozen=True)
class DashboardLimits:
    """Caps on what one collection keeps (a hostile peer fills its own rows up to these, no more).

    Attributes:
        max_text: characters kept of any string a peer reports (role, version, run id, uid).
        max_peers: peers shown (the serving peer first, then by PeerID).
        max_experts_per_peer: experts taken from one peer's `Info` answer.
        max_experts: experts in the whole grid.
        max_run_peers: reports shown per training run.
        max_runs: training runs shown (named ones, or those the peers' answers name).
        max_runs_per_peer: runs taken from one peer's answer.
        max_links_per_peer: link measurements taken from one peer's answer.
        max_rejections: rows of rejected expert answers (client, server) shown.
    """

    max_text: int = 96
    max_peers: int = 512
    max_experts_per_peer: int = 4096
    max_experts: int = 16384
    max_run_peers: int = 256
    max_runs: int = 16
    max_runs_per_peer: int = 8
    max_links_per_peer: int = 32
    max_rejections: int = 256

    def __post_init__(self) -> None:
        bad = [f.name for f in fields(self) if getattr(self, f.name) < 1]
        if bad:
            raise ValueError(f"DashboardLimits.{', '.join(bad)} must be positive")


@dataclass(frozen=True)
class PeerAnswer:
    """One peer as the collector met it: its `Info` answer, or the failure to get one.

    Attributes:
        peer_id: the PeerID that was dialed (an answer from another one is not taken).
        answered: True if `Info` came back.
        role, version, reachability: as the peer reports them (free text).
        client_mode: the peer only dials out.
        experts: expert uids the peer says it serves.
        relays: PeerIDs of the relays the peer holds reservations on.
        rtt_ms: round-trip time of the `Info` call, None when it failed or was not made (this peer).
        first_seen: when this dashboard first saw the peer (DHT time).
        uptime_s: how long the peer says it has been running (None: not said).
        links: what the peer measured of its links to others.
        runs: training runs the peer says it reports progress in.
        expert_load: per expert it serves: ``(uid, batches processed, tasks queued)``.
        forward_ms: the mean time it took to answer an expert Forward lately (None: unknown).
        rejected: ``(server PeerID, count)``: answers of that server's experts its mixtures rejected.
    """

    peer_id: str
    answered: bool
    role: str = ""
    version: str = ""
    reachability: str = ""
    client_mode: bool = False
    experts: tuple[str, ...] = ()
    relays: tuple[str, ...] = ()
    rtt_ms: float | None = None
    first_seen: float = 0.0
    uptime_s: float | None = None
    links: tuple[LinkMeasure, ...] = ()
    runs: tuple[str, ...] = ()
    expert_load: tuple[tuple[str, int, int], ...] = ()
    forward_ms: float | None = None
    rejected: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class LinkMeasure:
    """A peer's own measurement of its link to another (`swarm.net.estimates`)."""

    peer_id: str
    rtt_ms: float | None
    throughput: float | None
    """Bytes per second."""


@dataclass(frozen=True)
class RunReports:
    """A training run's live progress reports, as read from `<run_id>.progress`."""

    run_id: str
    reports: tuple[PeerProgress, ...]
    error: str = ""


@dataclass(frozen=True)
class ExpertDeclaration:
    """An expert declared in the DHT: its uid and the PeerID of the server at the address given."""

    uid: str
    server: str


def short_id(peer_id: str) -> str:
    """The last 8 characters of a PeerID: enough to tell peers apart on a page."""
    return "…" + peer_id[-8:] if len(peer_id) > 10 else peer_id


def _text(value: object, limit: int) -> str:
    text = value if isinstance(value, str) else ""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _number(value: float | None, digits: int = 3) -> float | None:
    return round(value, digits) if value is not None and math.isfinite(value) else None


def _reachability(answer: PeerAnswer) -> str:
    if not answer.answered:
        return "unreachable"
    if answer.client_mode:
        return "client"
    if answer.relays or answer.reachability == "private":
        return "relayed"
    return answer.reachability if answer.reachability in ("public", "unknown") else "unknown"


@dataclass(frozen=True)
class ExpertGrid:
    """The expert grid: who serves each expert (the DHT's declarations first, then what peers'
    `Info` answers add, each peer's capped) and its load as its server reports it, in the page's form."""

    serving: dict[str, int]
    """PeerID -> experts it serves in the grid."""
    json: dict[str, object]
    """``{"total", "truncated", "grids": [{"prefix", "rows": [[uid, server PeerID, batches, queued,
    batches/s or None], ...]}]}`` (batches and queue as the server answers; -1: it did not say)."""
    batches: dict[tuple[str, str], int]
    """(server, uid) -> batches it reported, for the next grid's rates."""

    @classmethod
    def build(cls, declared: Iterable[ExpertDeclaration], answers: Sequence[PeerAnswer], limits: DashboardLimits,
              previous: Mapping[tuple[str, str], int] | None = None, seconds: float = 0.0) -> ExpertGrid:
        """Args:
            previous, seconds: the batches of the grid before and the time since it, for rates.
        """
        cap = limits.max_text
        experts: dict[str, str] = {}
        truncated = False
        for d in declared:
            if len(experts) >= limits.max_experts:
                truncated = True
                break
            experts.setdefault(_text(d.uid, cap), d.server)
        loads: dict[tuple[str, str], tuple[int, int]] = {}
        for a in answers:
            for uid in a.experts[: limits.max_experts_per_peer]:
                if len(experts) >= limits.max_experts:
                    truncated = True
                    break
                experts.setdefault(_text(uid, cap), a.peer_id)
            truncated = truncated or len(a.experts) > limits.max_experts_per_peer
            for uid, batches, queued in a.expert_load[: limits.max_experts_per_peer]:
                loads[(a.peer_id, _text(uid, cap))] = (batches, queued)
        serving: dict[str, int] = {}
        grids: dict[str, list[list[object]]] = {}
        counted: dict[tuple[str, str], int] = {}
        for uid, server in sorted(experts.items()):
            serving[server] = serving.get(server, 0) + 1
            grid = uid.split(".", 1)[0] + "." if "." in uid else uid
            batches, queued = loads.get((server, uid), (-1, -1))
            rate = None
            if batches >= 0:
                counted[(server, uid)] = batches
                before = (previous or {}).get((server, uid))
                if before is not None and seconds > 0 and batches >= before:
                    rate = round((batches - before) / seconds, 2)
            # the page looks up the server's RTT and Forward latency in the peers' rows
            grids.setdefault(grid, []).append([uid, _text(server, cap), batches, queued, rate])
        return cls(serving, {"total": len(experts), "truncated": truncated,
                             "grids": [{"prefix": p, "rows": rows} for p, rows in grids.items()]}, counted)


def _last_round(reports: Sequence[PeerProgress]) -> Snapshot | None:
    """The swarm's latest averaging round as its peers report it: the group sizes they saw, how
    many of them failed it, and the most members a group left out of its mean (failed senders, or
    peers excluded by robust aggregation)."""
    rounds = [r.last_round for r in reports if r.last_round is not None]
    if not rounds:
        return None
    epoch = max(r.epoch for r in rounds)
    latest = [r for r in rounds if r.epoch == epoch]
    return {"epoch": epoch, "peers": len(latest), "group_sizes": sorted({r.group_size for r in latest}),
            "failed": sum(1 for r in latest if not r.ok),
            "excluded": max((r.group_size - r.contributors for r in latest if r.ok), default=0)}


class GridCache:
    """Keeps the last `ExpertGrid` while its inputs stay the same: the declarations (named by a
    generation their reader bumps at each read) and what each peer's answer lists. Each new grid
    takes the servers' loads of the moment, and batches per second since the grid before."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._grid: ExpertGrid | None = None
        self._built = 0.0

    def get(self, generation: int, declared: Sequence[ExpertDeclaration], answers: Sequence[PeerAnswer],
            limits: DashboardLimits, now: float = 0.0) -> ExpertGrid:
        key = (generation, tuple((a.peer_id, a.experts) for a in answers))
        if self._grid is None or key != self._key:
            previous = self._grid.batches if self._grid is not None else None
            self._grid = ExpertGrid.build(declared, answers, limits, previous, now - self._built)
            self._key, self._built = key, now
        return self._grid


def build_view(
    now: float, self_id: str, answers: Sequence[PeerAnswer], runs: Sequence[RunReports],
    declared: Iterable[ExpertDeclaration] | ExpertGrid, contributions: Mapping[str, Mapping[str, float]],
    limits: DashboardLimits,
) -> Snapshot:
    """The page's snapshot (JSON-able): peers, training runs and the expert grid.

    Args:
        now: DHT time of the collection.
        self_id: the serving peer's PeerID (listed first).
        answers: the peers met, with their `Info` answers.
        runs: each named run's live reports.
        declared: experts found in the DHT, or the grid built of them (`ExpertGrid`, which a
            collector keeps while neither the declarations nor the peers' answers change).
        contributions: ``{run_id: {peer_id: samples in the last hour}}`` (`History.contributions`).
        limits: the caps (see `DashboardLimits`).
    """
    cap = limits.max_text
    trainers = {r.peer_id for run in runs for r in run.reports}
    relays = {relay for a in answers for relay in a.relays}
    grid = declared if isinstance(declared, ExpertGrid) else ExpertGrid.build(declared, answers, limits)
    serving = grid.serving

    by_id = {a.peer_id: a for a in answers}
    # trainers in client mode answer no Info: they are known from their progress reports alone
    for run in runs:
        for r in run.reports:
            if r.peer_id not in by_id:
                by_id[r.peer_id] = PeerAnswer(r.peer_id, answered=r.client_mode, client_mode=r.client_mode,
                                              first_seen=r.time)
    ordered = sorted(by_id.values(), key=lambda a: (a.peer_id != self_id, not a.answered, a.peer_id))
    seen_by_others = _links_to(answers, limits)
    rejections, rejected_by_server = _rejections(answers, limits)
    peers = []
    for a in ordered[: limits.max_peers]:
        roles = []
        if a.peer_id in trainers or a.runs:
            roles.append("trainer")
        if serving.get(a.peer_id):
            roles.append("expert server")
        if a.peer_id in relays:
            roles.append("relay")
        if "archive" in a.role:
            roles.append("archive")
        peers.append({
            "id": _text(a.peer_id, cap), "short": short_id(_text(a.peer_id, cap)), "self": a.peer_id == self_id,
            "reachability": _reachability(a), "version": _text(a.version, cap), "role": _text(a.role, cap),
            "roles": roles, "rtt_ms": _number(a.rtt_ms), "seen_s": round(max(0.0, now - a.first_seen), 1),
            "experts": serving.get(a.peer_id, 0), "uptime_s": _number(a.uptime_s, 0),
            **seen_by_others.get(a.peer_id, {"link_rtt_ms": None, "link_mbps": None, "link_reporters": 0}),
            "links": len(a.links), "forward_ms": _number(a.forward_ms, 2),
            "runs": [_text(r, cap) for r in a.runs[: limits.max_runs_per_peer]],
            "rejected_answers": rejected_by_server.get(a.peer_id, 0),
        })

    run_views = []
    for run in runs:
        reports = sorted(run.reports, key=lambda r: r.peer_id)[: limits.max_run_peers]
        target = max((r.target_batch_size or 0 for r in reports), default=0) or None
        view: Snapshot = {"run_id": _text(run.run_id, cap), "error": _text(run.error, cap),
                                "peers": [], "epoch": None, "samples": 0, "target": target, "sps": 0.0,
                                "num_peers": len(reports), "loss": None}
        if reports:
            summary = summarize(reports, max(reports, key=lambda r: r.epoch), target, now, 0.0)
            losses = [r.loss for r in reports if r.loss is not None]
            view.update(epoch=summary.epoch, samples=summary.samples, sps=_number(summary.samples_per_second, 1),
                        loss=_number(sum(losses) / len(losses), 4) if losses else None)
        view["last_round"] = _last_round(reports)
        hour = contributions.get(run.run_id, {})
        for r in reports:
            view["peers"].append({
                "id": _text(r.peer_id, cap), "short": short_id(_text(r.peer_id, cap)), "epoch": r.epoch,
                "samples": r.samples, "sps": _number(r.samples_per_second, 1), "loss": _number(r.loss, 4),
                "age_s": round(max(0.0, now - r.time), 1), "samples_last_hour": round(hour.get(r.peer_id, 0.0)),
                "round": None if r.last_round is None else {
                    "epoch": r.last_round.epoch, "ok": r.last_round.ok, "group": r.last_round.group_size,
                    "in_mean": r.last_round.contributors, "seconds": _number(r.last_round.seconds, 2)},
            })
        run_views.append(view)

    return {
        "now": now, "self": short_id(self_id),
        "peers": peers, "peers_total": len(by_id), "peers_truncated": len(by_id) > limits.max_peers,
        "runs": run_views,
        "rejections": rejections,
        "experts": grid.json,
    }


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]  # the lower median: a minority of liars cannot move it past an honest value


def _links_to(answers: Sequence[PeerAnswer], limits: DashboardLimits) -> dict[str, dict[str, float | int | None]]:
    """Per peer, what the other peers measured of their links to it: the median RTT (ms) and
    throughput (MB/s) over those that measured it, and how many did."""
    rtts: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    reporters: dict[str, int] = {}
    for a in answers:
        for link in a.links[: limits.max_links_per_peer]:
            if link.peer_id == a.peer_id:
                continue
            reporters[link.peer_id] = reporters.get(link.peer_id, 0) + 1
            if link.rtt_ms is not None:
                rtts.setdefault(link.peer_id, []).append(link.rtt_ms)
            if link.throughput is not None:
                rates.setdefault(link.peer_id, []).append(link.throughput / 1e6)
    return {pid: {"link_rtt_ms": _number(_median(rtts[pid]), 2) if pid in rtts else None,
                  "link_mbps": _number(_median(rates[pid]), 2) if pid in rates else None,
                  "link_reporters": n} for pid, n in reporters.items()}


def _rejections(answers: Sequence[PeerAnswer], limits: DashboardLimits) -> tuple[list[dict[str, object]], dict[str, int]]:
    """The expert answers rejected by the peers' own checks: rows (reporting client, server, count),
    most first and capped, and per server the total over the clients that reported it."""
    cap = limits.max_text
    found: list[tuple[int, str, str]] = []
    totals: dict[str, int] = {}
    for a in answers:
        for server, count in a.rejected:
            totals[server] = totals.get(server, 0) + count
            found.append((count, _text(a.peer_id, cap), _text(server, cap)))
    found.sort(key=lambda r: (-r[0], r[1], r[2]))
    rows: list[dict[str, object]] = [
        {"client": client, "client_short": short_id(client), "server": server, "server_short": short_id(server),
         "count": count} for count, client, server in found[: limits.max_rejections]]
    return rows, totals


@dataclass
class _Series:
    t: deque[float] = field(default_factory=deque)
    epoch: deque[float | None] = field(default_factory=deque)
    sps: deque[float | None] = field(default_factory=deque)
    loss: deque[float | None] = field(default_factory=deque)


class History:
    """The serving peer's memory of the last `seconds`: per run its epoch, samples/s and mean loss,
    the number of peers, and each peer's samples (for the last hour's contributions).

    Args:
        seconds: how far back the curves go.
        max_points: points kept per curve (older ones are dropped first).
        max_runs: runs remembered (a run named later than that is not charted).
    """

    def __init__(self, seconds: float = 3 * 3600.0, max_points: int = 4000, max_runs: int = 16) -> None:
        if seconds <= 0 or max_points < 2 or max_runs < 1:
            raise ValueError("History needs positive seconds, max_points >= 2 and max_runs >= 1")
        self.seconds = seconds
        self.max_points = max_points
        self.max_runs = max_runs
        self.peers = _Series()
        self.runs: dict[str, _Series] = {}
        self._samples: dict[str, dict[str, deque[tuple[float, float]]]] = {}
        self._last_seen: dict[str, dict[str, tuple[float, float]]] = {}
        self._rounds: dict[str, deque[Snapshot]] = {}

    def record(self, view: Snapshot) -> None:
        """Takes in one snapshot of `build_view`."""
        now = float(view["now"])
        answering = sum(1 for p in view["peers"] if p["reachability"] != "unreachable")
        self._append(self.peers, now, float(answering), None, None)  # the peer count rides in `epoch`
        for run in view["runs"]:
            run_id = run["run_id"]
            if run["epoch"] is None:
                continue  # no live report: nothing to draw (the curve resumes where reports do)
            if run_id not in self.runs and len(self.runs) >= self.max_runs:
                continue
            series = self.runs.setdefault(run_id, _Series())
            self._append(series, now, run["epoch"], run["sps"], run["loss"])
            self._count_samples(run_id, now, run["peers"])
            last = run.get("last_round")
            rounds = self._rounds.setdefault(run_id, deque(maxlen=_MAX_ROUNDS))
            if last is not None and (not rounds or rounds[-1]["epoch"] < last["epoch"]):
                rounds.append(last)
            elif last is not None and rounds[-1]["epoch"] == last["epoch"]:
                rounds[-1] = last  # more of its peers have reported it since

    def rounds(self, run_id: str) -> list[Snapshot]:
        """The run's recent averaging rounds, newest first (`_last_round` of each epoch seen)."""
        return list(reversed(self._rounds.get(run_id, ())))

    def _append(self, s: _Series, now: float, epoch: float | None, sps: float | None, loss: float | None) -> None:
        s.t.append(now)
        s.epoch.append(epoch)
        s.sps.append(sps)
        s.loss.append(loss)
        while s.t and (len(s.t) > self.max_points or s.t[0] < now - self.seconds):
            s.t.popleft()
            s.epoch.popleft()
            s.sps.popleft()
            s.loss.popleft()

    def _count_samples(self, run_id: str, now: float, peers: Sequence[Snapshot]) -> None:
        """Each peer's samples since the last snapshot, from its reported throughput over the
        interval (capped at 60 s: a peer not seen for longer contributed nothing we can tell)."""
        last = self._last_seen.setdefault(run_id, {})
        counts = self._samples.setdefault(run_id, {})
        for p in peers:
            pid, sps = p["id"], p["sps"] or 0.0
            previous = last.get(pid)
            if previous is not None:
                dt = min(max(0.0, now - previous[0]), 60.0)
                counts.setdefault(pid, deque()).append((now, dt * (previous[1] + sps) / 2))
            last[pid] = (now, sps)
        for pid in list(counts):
            ring = counts[pid]
            while ring and (ring[0][0] < now - 3600.0 or len(ring) > _MAX_SAMPLE_POINTS):
                ring.popleft()
            if not ring:
                del counts[pid]
                last.pop(pid, None)

    def contributions(self) -> dict[str, dict[str, float]]:
        """``{run_id: {peer_id: samples in the last hour}}``, estimated from reported throughput."""
        return {run: {pid: sum(n for _, n in ring) for pid, ring in peers.items()}
                for run, peers in self._samples.items()}

    def to_json(self) -> Snapshot:
        """The curves as columns (uPlot's data layout: times, then one list per series)."""
        return {
            "peers": {"t": list(self.peers.t), "count": list(self.peers.epoch)},
            "runs": {run: {"t": list(s.t), "epoch": list(s.epoch), "sps": list(s.sps), "loss": list(s.loss)}
                     for run, s in self.runs.items()},
        }


class Picture:
    """The page's snapshots in sequence: each built by `build_view` with the expert grid kept while
    its inputs stay the same (`GridCache`), then remembered (`History`), with its runs' recent
    averaging rounds added. What the collector and the synthetic swarm both feed.

    Args:
        limits: the caps.
        history_seconds: how far back the curves go.
    """

    def __init__(self, limits: DashboardLimits, history_seconds: float = 3 * 3600.0) -> None:
        self.limits = limits
        self.history = History(history_seconds)
        self.grid = GridCache()

    def snapshot(self, now: float, self_id: str, answers: Sequence[PeerAnswer], runs: Sequence[RunReports],
                 declared: Sequence[ExpertDeclaration], generation: int) -> Snapshot:
        """The next snapshot; `generation` names the declarations (bumped at each read of them)."""
        grid = self.grid.get(generation, declared, answers, self.limits, now)
        view = build_view(now, self_id, answers, runs, grid, self.history.contributions(), self.limits)
        self.history.record(view)
        for run in view["runs"]:
            run["rounds"] = self.history.rounds(run["run_id"])
        return view
