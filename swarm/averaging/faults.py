"""Fault injection for averaging rounds: named points in the protocol where a test can act.

Production code calls `await plan.hit(point, ...)` at each point; with no plan (the default
`NO_FAULTS`) that is a no-op. Tests build a `FaultPlan` and pass it to the `Averager`:

    plan = FaultPlan().add(FaultPoint.AFTER_CHUNKS_SENT, Action.KILL, after=3)

kills the process (SIGKILL, no cleanup) once it has sent 3 chunks in a round. Faults are never
injected by copying production code into tests (STYLE.md).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
from dataclasses import dataclass, field

from swarm.core.errors import SwarmError

logger = logging.getLogger(__name__)


class FaultPoint(enum.Enum):
    """Where in a round a fault can be injected."""

    BEFORE_MATCHMAKING = "before_matchmaking"
    BEFORE_REDUCE_SCATTER = "before_reduce_scatter"    # member, group known, nothing sent yet
    AFTER_CHUNKS_SENT = "after_chunks_sent"            # member, count = chunks sent this round
    AFTER_CHUNKS_RECEIVED = "after_chunks_received"    # reducer, count = chunks received this round
    BEFORE_REPORT = "before_report"                    # reducer, all senders done or dropped
    BEFORE_DECISION = "before_decision"                # leader, reports collected
    BEFORE_ALL_GATHER = "before_all_gather"            # reducer, decision known, nothing sent back
    DURING_ALL_GATHER = "during_all_gather"            # reducer, count = result chunks sent
    AFTER_RESULTS_RECEIVED = "after_results_received"  # member, count = result chunks received
    BEFORE_APPLY = "before_apply"                      # member, every part held
    DURING_STATE_TRANSFER = "during_state_transfer"    # state server, count = chunks sent


class Action(enum.Enum):
    """What happens at a fault point."""

    DELAY = "delay"        # sleep `seconds` (a stall)
    DROP = "drop"          # break the stream being served or sent (raises FaultInjected there)
    RAISE = "raise"        # raise FaultInjected in the component (same effect as DROP outside streams)
    KILL = "kill"          # SIGKILL this process
    STOP = "stop"          # SIGSTOP this process (a test sends SIGCONT)
    LIE = "lie"            # a reducer adds `seconds` to every value of its result (a lying reducer)


class FaultInjected(SwarmError, ConnectionError):
    """Raised where a DROP or RAISE fault fires; handled like a broken connection."""


@dataclass
class Fault:
    """One planned fault.

    Attributes:
        point: where it fires.
        action: what it does.
        after: fires once the point's count (chunks, for the counting points) reaches this.
        rounds: fires only in these rounds (0-based count of the averager's rounds); None: any.
        times: how many times it may fire in total.
        seconds: duration of a DELAY.
    """

    point: FaultPoint
    action: Action
    after: int = 0
    rounds: frozenset[int] | None = None
    times: int = 1
    seconds: float = 0.0
    fired: int = field(default=0, init=False)


class FaultPlan:
    """A list of faults to fire at named points; empty by default."""

    def __init__(self, faults: list[Fault] | None = None) -> None:
        self.faults: list[Fault] = list(faults or ())
        self.round_index = 0

    def add(
        self, point: FaultPoint, action: Action, *, after: int = 0, rounds: set[int] | None = None,
        times: int = 1, seconds: float = 0.0,
    ) -> FaultPlan:
        """Adds a fault; returns the plan so calls chain."""
        self.faults.append(Fault(point, action, after, frozenset(rounds) if rounds is not None else None,
                                 times, seconds))
        return self

    def __bool__(self) -> bool:
        return bool(self.faults)

    def take(self, point: FaultPoint, action: Action) -> Fault | None:
        """For actions the component carries out itself (LIE): the first matching fault, now fired."""
        for fault in self.faults:
            if fault.point is point and fault.action is action and fault.fired < fault.times and (
                    fault.rounds is None or self.round_index in fault.rounds):
                fault.fired += 1
                return fault
        return None

    async def hit(self, point: FaultPoint, count: int = 0) -> None:
        """Called by production code at `point`; fires the first matching fault, if any."""
        for fault in self.faults:
            if fault.point is not point or fault.fired >= fault.times or count < fault.after or fault.action is Action.LIE:
                continue
            if fault.rounds is not None and self.round_index not in fault.rounds:
                continue
            fault.fired += 1
            await _fire(fault)
            return


async def _fire(fault: Fault) -> None:
    logger.info("fault injected: %s at %s", fault.action.value, fault.point.value)
    if fault.action is Action.DELAY:
        await asyncio.sleep(fault.seconds)
    elif fault.action in (Action.DROP, Action.RAISE):
        raise FaultInjected(f"injected {fault.action.value} at {fault.point.value}")
    elif fault.action is Action.KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action is Action.STOP:
        os.kill(os.getpid(), signal.SIGSTOP)


NO_FAULTS = FaultPlan()
