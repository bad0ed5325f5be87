"""One averaging round: the all-reduce over a group that matchmaking formed, with everything it
talks to built in one place.

`Averager.step` finds a group (`matchmaking`) and hands it to an `AveragingRound`, which reads
top to bottom as the round runs (docs/architecture.md, "Life of an averaging step"):

1. **timeline** (`RoundTimeline`): the round's timeout is the group's (the leader's measurement),
   within what the step has left; a sender silent for the round's expected time is dropped;
2. **agreement**: on the leader a `Coordinator` collects the reducers' reports and decides which
   contributors count; elsewhere reports go to the leader's `Report` RPC (`agreement.py`);
3. **verification** (verified rounds): members audit the parts they received and the leader's
   `Verdict` collects the audits (`audit.py`, `verification.py`);
4. **all-reduce**: `ButterflyAllReduce` sends this member's parts, reduces the part it owns,
   gathers the others' results and applies the decided mean (`allreduce.py`);
5. **release**: the round's buffer stays reachable until every member fetched what it needs
   from here, then goes back to the pool.

The outcome is an `AveragingResult`, or `RoundFailed` (an `AveragingError`) with the tensors
untouched.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarm.averaging.agreement import Coordinator, Decision, Report
from swarm.averaging.allreduce import ButterflyAllReduce, RoundCheck
from swarm.averaging.audit import AskVerdict, audit_round
from swarm.averaging.buffers import ScratchPool
from swarm.averaging.config import AllReduceConfig
from swarm.averaging.group import GroupInfo
from swarm.averaging.liveness import refuses_connections
from swarm.averaging.partition import FlatTensors
from swarm.averaging.parts import RoundFailed, scratch_numel
from swarm.averaging.reducer import ReportFn
from swarm.averaging.service import REPORT, VERIFY, AveragingService, RoundEntry
from swarm.averaging.timing import RoundTiming, clamp
from swarm.averaging.verification import Verdict
from swarm.core.faults import FaultPlan
from swarm.core.loop import spawn
from swarm.dht.handle import PeerHandle
from swarm.proto import averaging_pb2

__all__ = ["AveragingResult", "AveragingRound", "RoundTimeline", "clipping_of"]


@dataclass(frozen=True)
class AveragingResult:
    """The outcome of a successful step, the same on every member that got one.

    Attributes:
        round_id: hex id of the round.
        group: PeerIDs of the group's members, leader first.
        contributors: PeerIDs whose tensors are in the mean.
        weights: weight of each contributor.
        excluded: PeerID -> why its tensors are not in the mean (stalled, died, non-finite, ...).
        clipped: robust mode: PeerID -> how much of each contributor's input CenteredClip cut away,
            averaged over the parts by their sizes (0: none; 0.9: its distance from the centre
            counted for a tenth); empty in plain mode.
        clip_tau: robust mode: the clipping radius of each part, in part order.
    """

    round_id: str
    group: tuple[str, ...]
    contributors: tuple[str, ...]
    weights: dict[str, float]
    excluded: dict[str, str] = field(default_factory=dict)
    clipped: dict[str, float] = field(default_factory=dict)
    clip_tau: tuple[float, ...] = ()

    @classmethod
    def from_decision(cls, group: GroupInfo, decision: Decision,
                      clipping: tuple[dict[int, float], tuple[float, ...]] | None = None) -> AveragingResult:
        ids = group.peer_ids
        clipped, taus = clipping or ({}, ())
        return cls(
            round_id=group.round_id.hex(), group=ids,
            contributors=tuple(ids[i] for i in decision.contributors),
            weights={ids[i]: w for i, w in zip(decision.contributors, decision.weights)},
            excluded={ids[i]: reason for i, reason in decision.excluded.items()},
            clipped={ids[i]: c for i, c in clipped.items()}, clip_tau=taus,
        )


def clipping_of(allreduce: ButterflyAllReduce, decision: Decision) -> tuple[dict[int, float], tuple[float, ...]]:
    """Robust mode: (member index -> share clipped away, by part size; each part's radius), from the
    clip scales its reducer published (the same on every member)."""
    cut = dict.fromkeys(decision.contributors, 0.0)
    taus: list[float] = []
    total = 0
    for p in allreduce.parts:
        if p.index == allreduce.my_part and allreduce.reducer is not None and allreduce.reducer.clip is not None:
            scales, tau = allreduce.reducer.clip.scales, allreduce.reducer.clip.tau
        elif p.claim is not None:
            scales, tau = tuple(p.claim.clip_scales), p.claim.clip_tau
        else:
            scales, tau = (), 0.0
        taus.append(tau)
        if p.size and len(scales) == len(decision.contributors):
            total += p.size
            for i, c in zip(decision.contributors, scales):
                cut[i] += p.size * (1.0 - c)
    return ({i: v / total for i, v in cut.items()} if total else dict.fromkeys(cut, 0.0)), tuple(taus)



@dataclass(frozen=True)
class RoundTimeline:
    """When a round's deadlines fall, in loop time.

    Attributes:
        t0: the round's start on this member.
        timeout: seconds the round may take (the group's, within what the step has left).
        config: the all-reduce settings for this round (the silence limit fitted to the timeout).
    """

    t0: float
    timeout: float
    config: AllReduceConfig

    @classmethod
    def of(cls, group: GroupInfo, deadline: float, config: AllReduceConfig, adaptive: bool,
           timeout_multiple: float) -> RoundTimeline:
        """The timeline of `group`'s round for a step that must end by `deadline`; raises
        `RoundFailed` when no time is left."""
        now = asyncio.get_running_loop().time()
        timeout = min(group.timeout, deadline - now)
        if timeout <= 0:
            raise RoundFailed(group.round_id, "no time left for the all-reduce")
        if adaptive:
            # a sender silent for the round's expected time is dropped (the round's timeout, a
            # multiple of that time, comes from the leader's measurements)
            stall = clamp(timeout / timeout_multiple, 1.0, config.sender_timeout)
            config = dataclasses.replace(config, sender_timeout=stall)
        return cls(now, timeout, config)

    @property
    def end(self) -> float:
        return self.t0 + self.timeout

    @property
    def decide_by(self) -> float:
        """When the leader decides with the reports it has."""
        return self.t0 + self.config.decide_at * self.timeout

    @property
    def give_up_decision(self) -> float:
        """When a member stops waiting for the leader's decision."""
        return self.t0 + self.config.give_up_decision * self.timeout

    @property
    def release_by(self) -> float:
        """When the round's buffer goes back to the pool whoever still fetches from it."""
        return self.end + self.config.linger


class AveragingRound:
    """One member's side of one round, built complete: its timeline, its agreement (a
    `Coordinator` on the leader, the leader's `Report` RPC elsewhere), its verification, and its
    `ButterflyAllReduce`.

    Args:
        peer: the local peer.
        group: the group matchmaking formed.
        flat: this member's tensors as one flat vector (None for an auxiliary member).
        timeline: the round's deadlines (`RoundTimeline.of`).
        faults: the averager's fault plan.
        service: the peer's averaging service (routes the round's RPCs here while it runs).
        timing: what rounds took, taught by this one's outcome (the next timeout this peer leads).
        scratch: the pool the round's buffer comes from and goes back to.
        adopt: takes the work the round leaves running after `run` returns (its release, the
            streams left to end by themselves), which the averager cancels if it shuts down first.
        closing: whether the averager is shutting down (the round's streams are then cut at its
            release, not left to end).
    """

    def __init__(self, peer: PeerHandle, group: GroupInfo, flat: FlatTensors | None, timeline: RoundTimeline,
                 faults: FaultPlan, service: AveragingService, timing: RoundTiming, scratch: ScratchPool,
                 adopt: Callable[[asyncio.Task[object]], None], closing: Callable[[], bool]) -> None:
        self.peer, self.group, self.flat, self.timeline = peer, group, flat, timeline
        self.faults, self.service, self.timing, self.scratch = faults, service, timing, scratch
        self.adopt, self.closing = adopt, closing
        self.my_index = group.index_of(peer.peer_id)
        self.coordinator = Coordinator(group, timeline.decide_by, faults_hit=faults.hit, probe=self._refuses) \
            if self.my_index == 0 else None
        self.verdict = self._verdict() if timeline.config.verified and self.coordinator is not None else None

    async def run(self) -> AveragingResult:
        """Runs the all-reduce; the round's release (its buffer kept reachable for late fetches)
        goes on after this returns, as a task handed to `adopt`."""
        cfg, group = self.timeline.config, self.group
        report: ReportFn
        if self.coordinator is not None:
            self.coordinator.start()
            report = self.coordinator.submit
        else:
            report = self._report_to_leader
        if self.flat is not None:
            if self.flat.on_device:  # the copy from the device waits for its queued work: not on the loop
                await asyncio.to_thread(self.flat.refresh)
            else:
                self.flat.refresh()
        buffer = await self.scratch.acquire(scratch_numel(group, self.my_index))
        allreduce = ButterflyAllReduce(
            self.peer, group, self.flat, buffer, cfg, self.faults, self.timeline.end - asyncio.get_running_loop().time(),
            report, verify=self._check() if cfg.verified else None,
            on_gone=self.coordinator.member_gone if self.coordinator is not None else None)
        self.service.register(group.prefix, group.round_id, RoundEntry(allreduce, self.coordinator, self.verdict))
        try:
            decision = await allreduce.run()
        except RoundFailed:
            self.timing.observe_failure()  # the next round this peer leads gets more time
            raise
        else:
            # a round that left senders out (too late, stalled) was cut short by its timeline: its
            # time is a lower bound of what the round needs, and the next timeout grows with it
            self.timing.observe_success(asyncio.get_running_loop().time() - self.timeline.t0)
        finally:
            self.adopt(spawn(self._release(allreduce, buffer), name=f"avg-release-{group.round_id.hex()[:8]}"))
        clipping = clipping_of(allreduce, decision) if cfg.robust else None
        return AveragingResult.from_decision(group, decision, clipping)

    # -- agreement ---------------------------------------------------------------------------

    async def _refuses(self, index: int) -> bool:
        """Whether member `index` is known gone: its address refuses connections."""
        return await refuses_connections(self.group.members[index].addr)

    async def _report_to_leader(self, report: Report) -> Decision:
        channel = self.peer.pool.get(self.group.leader.addr)
        data = await channel.unary(REPORT, report.to_proto(self.group.prefix, self.group.round_id), None,
                                   timeout=max(0.01, self.timeline.give_up_decision - asyncio.get_running_loop().time()))
        return Decision.from_bytes(data)

    # -- verification ------------------------------------------------------------------------

    def _verdict(self) -> Verdict:
        """The leader's collector of the members' audits."""
        coordinator, group = self.coordinator, self.group
        assert coordinator is not None  # only the leader collects verdicts

        def expected() -> frozenset[int]:
            decision = coordinator.decision
            return frozenset(decision.contributors) if decision is not None else frozenset(group.senders)

        # members finish at about the same time; one gone after the decision costs at most this
        until = min(self.timeline.end - 0.05 * group.timeout, self.timeline.give_up_decision)
        return Verdict(group, expected, until, grace=self.timeline.config.sender_timeout)

    def _check(self) -> RoundCheck:
        """This member's audit of the round before it applies the mean."""
        ask: AskVerdict = self.verdict.submit if self.verdict is not None else self._ask_leader

        async def check(allreduce: ButterflyAllReduce, decision: Decision) -> None:
            await audit_round(allreduce, decision, ask)

        return check

    async def _ask_leader(self, report: averaging_pb2.VerifyReport) -> averaging_pb2.VerifyVerdict:
        channel = self.peer.pool.get(self.group.leader.addr)
        verdict: averaging_pb2.VerifyVerdict = await channel.unary(
            VERIFY, report, averaging_pb2.VerifyVerdict,
            timeout=max(0.01, self.timeline.end - asyncio.get_running_loop().time()))
        return verdict

    # -- release -----------------------------------------------------------------------------

    async def _release(self, allreduce: ButterflyAllReduce, buffer: torch.Tensor) -> None:
        """Keeps the round's results reachable until every stream to this peer closed (nobody can
        still fetch from us) or the linger ran out, then frees its buffer for the next round."""
        loop = asyncio.get_running_loop()
        until = self.timeline.release_by
        try:
            if allreduce.reducer is not None:
                # a sender that has not connected yet (late, or dead) holds the round until `until`,
                # unless the round is doomed (a part was aborted: no one applies it, no one fetches)
                closed = asyncio.ensure_future(allreduce.reducer.streams_closed.wait())
                doomed = asyncio.ensure_future(allreduce.doomed.wait())
                try:
                    await asyncio.wait({closed, doomed}, timeout=max(0.0, until - loop.time()),
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    closed.cancel()
                    doomed.cancel()
            if self.coordinator is not None and self.coordinator.decision is None:
                await asyncio.sleep(max(0.0, until - loop.time()))
        finally:
            self.service.unregister(self.group.prefix, self.group.round_id)
            for stream in allreduce.close(linger=not self.closing()):
                self.adopt(stream)
            if self.coordinator is not None:
                self.coordinator.close()
            self.scratch.release(buffer)
