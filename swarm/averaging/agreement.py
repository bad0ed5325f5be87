"""Agreement on a round's contributors: reducers report, the leader decides once.

Each reducer reports which senders' part arrived complete and finite (`Report`). The leader
(`Coordinator`) waits for every reducer's report or its deadline, then makes the round's single
`Decision`: the contributor set C is the intersection of the reported sets, or the round aborts
(a reducer did not report: its part cannot be averaged; no contributor with weight is left).
A reducer that a report names as broken (its stream to that reporter broke) and that has not
reported itself is probed (`Coordinator.probe`, e.g. a TCP connect to its address): when its
address refuses the connection, its process is gone and can never report, so the leader decides
(abort) at once instead of waiting for the report deadline. A probe that does not answer (a stalled
peer, a lost host) changes nothing: the deadline still decides.
The decision travels as exact bytes with every averaged part, so a member can check that all
parts it holds were reduced under the same decision; a member applies a round only when it holds
every part, so every member that applies applies the mean over the same C (docs/architecture.md, "Life of an averaging step").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from swarm.averaging.faults import FaultPoint
from swarm.averaging.group import GroupInfo
from swarm.proto import averaging_pb2

logger = logging.getLogger(__name__)

# reasons a reducer gives for a sender whose stream broke (`reducer.PartCollector._read`)
BROKEN_REASONS = ("stream broken", "stream ended early", "gone")


@dataclass(frozen=True)
class Report:
    """What a reducer saw of the senders of its part.

    Attributes:
        part: the reducer's part index.
        ok: member indices of senders whose part arrived complete and finite.
        failed: member index -> why that sender's part is unusable.
    """

    part: int
    ok: frozenset[int]
    failed: dict[int, str] = field(default_factory=dict)

    def to_proto(self, prefix: str, round_id: bytes) -> averaging_pb2.ReduceReport:
        failed = sorted(self.failed.items())
        return averaging_pb2.ReduceReport(
            prefix=prefix, round_id=round_id, part=self.part, ok_senders=sorted(self.ok),
            failed_senders=[i for i, _ in failed], failed_reasons=[r for _, r in failed],
        )

    @classmethod
    def from_proto(cls, msg: averaging_pb2.ReduceReport) -> Report:
        return cls(msg.part, frozenset(msg.ok_senders), dict(zip(msg.failed_senders, msg.failed_reasons)))


@dataclass(frozen=True)
class Decision:
    """The leader's one decision for a round.

    Attributes:
        round_id: the round.
        abort: True if the round fails for everyone.
        reason: why it aborts (empty otherwise).
        contributors: member indices whose data is in the mean (ascending).
        weights: their weights, in the same order.
        excluded: member index -> why its data is not in the mean (senders only).
    """

    round_id: bytes
    abort: bool = False
    reason: str = ""
    contributors: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    excluded: dict[int, str] = field(default_factory=dict)

    @property
    def total_weight(self) -> float:
        return float(sum(self.weights))

    def weight_of(self, index: int) -> float:
        return self.weights[self.contributors.index(index)]

    def to_bytes(self) -> bytes:
        excluded = sorted(self.excluded.items())
        return averaging_pb2.Decision(
            round_id=self.round_id, abort=self.abort, reason=self.reason, contributors=list(self.contributors),
            weights=list(self.weights), excluded=[i for i, _ in excluded], excluded_reasons=[r for _, r in excluded],
        ).SerializeToString(deterministic=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> Decision:
        msg = averaging_pb2.Decision.FromString(data)
        return cls(
            msg.round_id, msg.abort, msg.reason, tuple(msg.contributors), tuple(msg.weights),
            dict(zip(msg.excluded, msg.excluded_reasons)),
        )


def decide(group: GroupInfo, reports: dict[int, Report], gone: frozenset[int] = frozenset()) -> Decision:
    """The leader's rule: C = senders every reducer received complete and finite, with weight > 0.

    Args:
        group: the round's group.
        reports: part index -> that reducer's report (missing parts: the reducer did not report).
        gone: member indices known dead (their address refused a connection), named in the reason.

    Returns:
        A commit decision over C, or an abort when a part has no report or C carries no weight.
    """
    n_parts = len(group.reducers)
    missing = [p for p in range(n_parts) if p not in reports]
    if missing:
        who = ", ".join(group.members[group.reducers[p]].peer_id[-8:] for p in missing)
        dead = [group.members[i].peer_id[-8:] for i in sorted(gone)]
        why = f"; gone: {', '.join(dead)} refused connections" if dead else ""
        return Decision(group.round_id, abort=True, reason=f"reducer(s) {who} did not report (parts {missing}){why}")
    senders = [i for i in group.senders if group.members[i].weight > 0]
    excluded: dict[int, str] = {}
    contributors: list[int] = []
    for i in senders:
        reasons = [reports[p].failed.get(i, "no data") for p in range(n_parts) if i not in reports[p].ok]
        if reasons:
            excluded[i] = reasons[0]
        else:
            contributors.append(i)
    if not contributors:
        return Decision(group.round_id, abort=True, reason="no contributor's data arrived complete and finite",
                        excluded=excluded)
    weights = tuple(group.members[i].weight for i in contributors)
    return Decision(group.round_id, contributors=tuple(contributors), weights=weights, excluded=excluded)


class Coordinator:
    """The leader's side of agreement for one round: collects reports, decides once, answers all.

    Args:
        group: the round's group.
        report_deadline: loop time after which missing reports count as failed reducers.
        faults_hit: the owner's `FaultPlan.hit` (fault injection in tests).
        probe: True when member `i` is known gone (its address refuses connections).
    """

    def __init__(self, group: GroupInfo, report_deadline: float, *,
                 faults_hit: Callable[[FaultPoint], Awaitable[None]] | None = None,
                 probe: Callable[[int], Awaitable[bool]] | None = None) -> None:
        self.group = group
        self.report_deadline = report_deadline
        self.faults_hit = faults_hit
        self.probe = probe
        self.reports: dict[int, Report] = {}
        self._all_reported = asyncio.Event()
        self._decided: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._decider: asyncio.Task[None] | None = None
        self.gone: set[int] = set()
        self._probed: set[int] = set()
        self._probes: set[asyncio.Task[None]] = set()
        self._t0 = asyncio.get_running_loop().time()

    @property
    def decision(self) -> Decision | None:
        return self._decided.result() if self._decided.done() else None

    def start(self) -> None:
        from swarm.core.loop import spawn

        self._decider = spawn(self._decide_when_ready(), name=f"avg-decide-{self.group.round_id.hex()[:8]}")

    async def submit(self, report: Report) -> Decision:
        """Records one reducer's report and waits for the round's decision (long poll)."""
        if not 0 <= report.part < len(self.group.reducers):
            raise ValueError(f"no part {report.part} in this round")
        if not self._decided.done():
            self.reports.setdefault(report.part, report)
            if len(self.reports) == len(self.group.reducers):
                self._all_reported.set()
            else:
                self._probe_broken(report)
        return await asyncio.shield(self._decided)

    def _probe_broken(self, report: Report) -> None:
        """Probes the reducers this report names as broken that have not reported yet."""
        if self.probe is None:
            return
        reported = {self.group.reducers[p] for p in self.reports}
        for i, reason in report.failed.items():
            if (i in self._probed or i in reported or i not in self.group.reducers
                    or not reason.startswith(BROKEN_REASONS)):
                continue
            self._probed.add(i)
            task = asyncio.ensure_future(self._run_probe(i))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def _run_probe(self, i: int) -> None:
        assert self.probe is not None
        loop = asyncio.get_running_loop()
        try:
            gone = await asyncio.wait_for(self.probe(i), max(0.0, self.report_deadline - loop.time()))
        except (TimeoutError, OSError):
            return
        who = self.group.members[i].peer_id[-8:]
        logger.debug("round %s: probed reducer %s %.3f s after the start: %s", self.group.round_id.hex()[:8],
                     who, loop.time() - self._t0, "gone (connection refused): deciding now" if gone else "reachable")
        if gone:
            self.member_gone(i)

    def member_gone(self, i: int) -> None:
        """Member `i` is known dead (its address refused a connection: this coordinator's probe, or
        the leader's own member side after its stream to `i` broke). A reducer among the unreported
        can never report: the round is decided at once instead of at the deadline."""
        reported = {self.group.reducers[p] for p in self.reports}
        if self._decided.done() or i not in self.group.reducers or i in reported:
            return
        self.gone.add(i)
        self._all_reported.set()  # its report can never come: decide without waiting for the deadline

    async def _decide_when_ready(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self._all_reported.wait(), max(0.0, self.report_deadline - loop.time()))
        except TimeoutError:
            pass
        try:
            if self.faults_hit is not None:
                from swarm.averaging.faults import FaultPoint

                await self.faults_hit(FaultPoint.BEFORE_DECISION)
            decision = decide(self.group, dict(self.reports), frozenset(self.gone))
        except Exception as e:  # noqa: BLE001 - an injected fault or a bug: the round aborts
            decision = Decision(self.group.round_id, abort=True, reason=f"leader failed to decide: {e}")
        if not self._decided.done():
            logger.debug("round %s: decided %.3f s after the start: %s", self.group.round_id.hex()[:8],
                         loop.time() - self._t0, decision.reason or "commit")
            self._decided.set_result(decision)

    def close(self) -> None:
        if self._decider is not None:
            self._decider.cancel()
        for task in list(self._probes):
            task.cancel()
        if not self._decided.done():
            self._decided.set_result(Decision(self.group.round_id, abort=True, reason="leader shut down"))


def contributors_of(group: GroupInfo, decision: Decision) -> Sequence[str]:
    return [group.members[i].peer_id for i in decision.contributors]
