"""Fault injection for the DHT's outgoing calls: slow, lossy or dead links, for tests and simulations.

The protocol's client side (`DHTProtocol.call_*`) consults the `FaultPlan` in `DHTConfig` before
every request, so a simulation runs the real protocol code over real gRPC and only the links
misbehave. A dropped request behaves as a lost packet does: the caller waits out its timeout
and sees `DeadlineExceeded`; a refused one fails at once with `PeerUnreachable`, as a dead
host does. Without a plan (the default) nothing is consulted.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from swarm.core.errors import ConfigError, DeadlineExceeded, PeerUnreachable


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
    """What a plan did so far."""

    calls: int = 0
    delayed: int = 0
    lost: int = 0
    refused: int = 0


@dataclass
class FaultPlan:
    """Decides, per outgoing call, how its link misbehaves.

    The most specific rule wins: a rule for the (caller, callee) link, then one for the callee,
    then `default`. One plan may be shared by every node of a simulation.

    Args:
        default: What every link does unless a more specific rule says otherwise.
        seed: Seed of the plan's random choices, for repeatable runs.
    """

    default: LinkFault = field(default_factory=LinkFault)
    seed: int | None = None
    stats: FaultStats = field(default_factory=FaultStats)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._links: dict[tuple[str, str], LinkFault] = {}
        self._peers: dict[str, LinkFault] = {}
        self._sent: dict[tuple[str, str, LinkFault], int] = {}  # requests per link under a `lose_first` rule

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
