"""Fault injection for tests and simulations: one `FaultPlan` that the layers above consult.

A plan holds two kinds of rules, and production code asks it at fixed places; without a plan
(the default everywhere) nothing is consulted and nothing changes:

- *Faults at named points* of a protocol (`add`, `hit`): a layer names its points (averaging's
  `swarm.averaging.faults.FaultPoint`) and calls ``await plan.hit(point, count)`` at each; a
  matching `Fault` stalls (`Action.DELAY`), breaks the operation (`Action.DROP`/`Action.RAISE`
  raise `FaultInjected`, handled like a broken connection), or SIGKILLs or SIGSTOPs the process.

      plan = FaultPlan().add(FaultPoint.AFTER_CHUNKS_SENT, Action.KILL, after=3)

- *Link faults* on outgoing calls (`set_link`, `set_peer`, `apply`): the DHT's client side calls
  ``await plan.apply(caller, callee, timeout)`` before every request, so a simulation runs the real
  protocol over real gRPC and only the links misbehave. A lost request behaves as a lost packet
  does (the caller waits out its timeout and sees `DeadlineExceeded`); a refused one fails at once
  with `PeerUnreachable`, as a dead host does.

Faults are never injected by copying production code into tests.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import random
import signal
from collections.abc import Hashable
from dataclasses import dataclass, field

from swarm.core.errors import ConfigError, DeadlineExceeded, PeerUnreachable, SwarmError

logger = logging.getLogger(__name__)

__all__ = ["Action", "Fault", "FaultInjected", "FaultPlan", "FaultStats", "LinkFault"]


# --- faults at named points ---------------------------------------------------------------------


class Action(enum.Enum):
    """What happens at a fault point."""

    DELAY = "delay"        # sleep `seconds` (a stall)
    DROP = "drop"          # break the stream being served or sent (raises FaultInjected there)
    RAISE = "raise"        # raise FaultInjected in the component (same effect as DROP outside streams)
    KILL = "kill"          # SIGKILL this process
    STOP = "stop"          # SIGSTOP this process (a test sends SIGCONT)
    LIE = "lie"            # the component lies itself (`take`): a reducer adds `seconds` to its result


class FaultInjected(SwarmError, ConnectionError):
    """Raised where a DROP or RAISE fault fires; handled like a broken connection."""


@dataclass
class Fault:
    """One planned fault at a named point.

    Attributes:
        point: where it fires (a layer's point, e.g. a `swarm.averaging.faults.FaultPoint`).
        action: what it does.
        after: fires once the point's count (chunks, for the counting points) reaches this.
        rounds: fires only in these rounds (0-based count of the plan's `round_index`); None: any.
        times: how many times it may fire in total.
        seconds: duration of a DELAY.
    """

    point: Hashable
    action: Action
    after: int = 0
    rounds: frozenset[int] | None = None
    times: int = 1
    seconds: float = 0.0
    fired: int = field(default=0, init=False)


def _name(point: Hashable) -> str:
    return str(point.value if isinstance(point, enum.Enum) else point)


async def _fire(fault: Fault) -> None:
    logger.info("fault injected: %s at %s", fault.action.value, _name(fault.point))
    if fault.action is Action.DELAY:
        await asyncio.sleep(fault.seconds)
    elif fault.action in (Action.DROP, Action.RAISE):
        raise FaultInjected(f"injected {fault.action.value} at {_name(fault.point)}")
    elif fault.action is Action.KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action is Action.STOP:
        os.kill(os.getpid(), signal.SIGSTOP)


# --- link faults ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkFault:
    """How one link misbehaves.

    Attributes:
        delay: Seconds added before every request is sent.
        jitter: Up to this many more seconds, uniformly at random.
        loss: Probability that a request is lost (the caller times out).
        refuse: Every request fails at once, as if the callee were down.
        lose_first: The first this many requests over each link the rule covers are lost (a
            short outage), counted per (caller, callee) link.
    """

    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    refuse: bool = False
    lose_first: int = 0

    def __post_init__(self) -> None:
        if self.delay < 0 or self.jitter < 0:
            raise ConfigError("delay and jitter must be >= 0")
        if not 0.0 <= self.loss <= 1.0:
            raise ConfigError(f"loss is a probability, got {self.loss}")
        if self.lose_first < 0:
            raise ConfigError(f"lose_first must be >= 0, got {self.lose_first}")


@dataclass
class FaultStats:
    """What a plan's link faults did so far."""

    calls: int = 0
    delayed: int = 0
    lost: int = 0
    refused: int = 0


# --- the plan ---------------------------------------------------------------------------------------


class FaultPlan:
    """Faults at named points and link faults (see the module docstring); empty by default.

    Link rules: the most specific wins, a rule for the (caller, callee) link, then one for the
    callee, then `default`. One plan may be shared by every node of a simulation.

    Args:
        faults: faults at named points.
        default: What every link does unless a more specific rule says otherwise.
        seed: Seed of the plan's random choices (link loss and jitter), for repeatable runs.
    """

    def __init__(self, faults: list[Fault] | None = None, *, default: LinkFault | None = None,
                 seed: int | None = None) -> None:
        self.faults: list[Fault] = list(faults or ())
        self.round_index = 0
        """The round the owner is in (`Fault.rounds`); an averager counts its rounds here."""
        self.default = default if default is not None else LinkFault()
        self.seed = seed
        self.stats = FaultStats()
        self._rng = random.Random(seed)
        self._links: dict[tuple[str, str], LinkFault] = {}
        self._peers: dict[str, LinkFault] = {}
        self._sent: dict[tuple[str, str, LinkFault], int] = {}  # requests per link under a `lose_first` rule

    def __bool__(self) -> bool:
        """Whether any fault is planned at a named point."""
        return bool(self.faults)

    # -- named points ----------------------------------------------------------------------------

    def add(
        self, point: Hashable, action: Action, *, after: int = 0, rounds: set[int] | None = None,
        times: int = 1, seconds: float = 0.0,
    ) -> FaultPlan:
        """Adds a fault at `point`; returns the plan so calls chain."""
        self.faults.append(Fault(point, action, after, frozenset(rounds) if rounds is not None else None,
                                 times, seconds))
        return self

    def take(self, point: Hashable, action: Action) -> Fault | None:
        """For actions the component carries out itself (LIE): the first matching fault, now fired."""
        for fault in self.faults:
            if fault.point == point and fault.action is action and fault.fired < fault.times and (
                    fault.rounds is None or self.round_index in fault.rounds):
                fault.fired += 1
                return fault
        return None

    async def hit(self, point: Hashable, count: int = 0) -> None:
        """Called by production code at `point`; fires the first matching fault, if any."""
        for fault in self.faults:
            if fault.point != point or fault.fired >= fault.times or count < fault.after or fault.action is Action.LIE:
                continue
            if fault.rounds is not None and self.round_index not in fault.rounds:
                continue
            fault.fired += 1
            await _fire(fault)
            return

    # -- links -----------------------------------------------------------------------------------

    def set_link(self, caller: str, callee: str, fault: LinkFault) -> None:
        """Sets how calls from `caller` to `callee` (PeerIDs) misbehave."""
        self._links[caller, callee] = fault

    def set_peer(self, callee: str, fault: LinkFault) -> None:
        """Sets how every call to `callee` misbehaves (`LinkFault(refuse=True)`: it is down)."""
        self._peers[callee] = fault

    def clear(self) -> None:
        """Forgets every link and peer rule (the default stays)."""
        self._links.clear()
        self._peers.clear()
        self._sent.clear()

    def fault_for(self, caller: str, callee: str) -> LinkFault:
        return self._links.get((caller, callee)) or self._peers.get(callee) or self.default

    async def apply(self, caller: str, callee: str, timeout: float) -> float:
        """Delays the call, or raises as a lost or refused call would (after `timeout` if lost).

        Returns:
            The seconds spent delaying, which the caller takes off the call's own timeout.

        Raises:
            PeerUnreachable: The link refuses calls.
            DeadlineExceeded: The request was lost; raised once `timeout` has passed.
        """
        fault = self.fault_for(caller, callee)
        self.stats.calls += 1
        if fault.refuse:
            self.stats.refused += 1
            raise PeerUnreachable(f"fault plan: {callee} is unreachable", peer_id=callee)
        lost = False
        if fault.lose_first:
            sent = self._sent.get((caller, callee, fault), 0)
            self._sent[caller, callee, fault] = sent + 1
            lost = sent < fault.lose_first
        if lost or (fault.loss and self._rng.random() < fault.loss):
            self.stats.lost += 1
            await asyncio.sleep(timeout)
            raise DeadlineExceeded(f"fault plan: request to {callee} was lost", peer_id=callee)
        delay = fault.delay + (self._rng.uniform(0.0, fault.jitter) if fault.jitter else 0.0)
        if delay > 0:
            self.stats.delayed += 1
            await asyncio.sleep(min(delay, timeout))
            if delay >= timeout:
                raise DeadlineExceeded(f"fault plan: request to {callee} took over {timeout} s", peer_id=callee)
            return delay
        return 0.0
