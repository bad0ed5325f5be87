"""What the optimizer needs from averaging, and its binding to `swarm.Averager`.

The optimizer asks one thing of a round: average these tensors in place with this weight,
within this timeout, and say how many peers took part, or raise `AveragingError` (the same
error on every member, docs/architecture.md). `AveragerLike` states that; `SwarmAverager` adapts
`swarm.Averager` to it. Another group-forming strategy (a static group, a test double) plugs
in through `Optimizer(averager_factory=...)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from swarm.compression import CompressionType, get_codec
from swarm.dht.handle import PeerHandle
from swarm.optim.config import CollaborationConfig

if TYPE_CHECKING:
    from swarm.averaging import Averager


@dataclass(frozen=True)
class RoundResult:
    """The part of a round's result the optimizer uses.

    Attributes:
        group_size: members of the group.
        contributors: members whose tensors are in the mean.
        bytes_sent: bytes this peer sent in the round (0 when unknown).
    """

    group_size: int
    contributors: int
    bytes_sent: int = 0


class AveragerLike(Protocol):
    """Averages a fixed list of tensors in place with the other members of a group."""

    async def astep(self, weight: float, timeout: float, expected_size: int, group_key: str) -> RoundResult:
        """Runs one round; raises `swarm.core.errors.AveragingError` when it fails.

        Args:
            weight: this peer's weight in the mean (its sample count).
            timeout: seconds the whole round may take.
            expected_size: how many peers the progress records say will join (a hint: a
                round may start once that many are present instead of waiting longer).
            group_key: names the round (the epoch): only peers about to take the same step
                may group together.
        """
        ...

    def abandon_matchmaking(self, reason: str) -> bool:
        """Stops the running `astep` if it has not formed a group yet (it then raises
        `AveragingError`); returns False, changing nothing, once a group formed."""
        ...

    async def ashutdown(self) -> None:
        """Leaves: withdraws from matchmaking and stops serving (the optimizer calls it at shutdown)."""
        ...

    async def aannounce(self, ready_in: float, group_key: str) -> bool:
        """Tells the peers of round `group_key` that this peer will join it in about `ready_in`
        seconds, so a leader waits for it; False when the strategy has no such notion."""
        ...

    def round_trip(self) -> float | None:
        """The smoothed round-trip time this peer measured to the others (None: nothing measured,
        or the strategy measures none)."""
        ...


class SwarmAverager:
    """`AveragerLike` over `swarm.Averager`.

    Args:
        averager: the `swarm.Averager` of this peer over the averaged buffers.
        wire_bytes_per_element: bytes one element takes on the wire with the chosen compression.
    """

    def __init__(self, averager: Averager, wire_bytes_per_element: float) -> None:
        self.averager = averager
        self.numel = sum(t.numel() for t in averager.tensors)
        self.wire_bytes_per_element = wire_bytes_per_element
        self.bytes_sent = 0

    async def astep(self, weight: float, timeout: float, expected_size: int, group_key: str) -> RoundResult:
        # the group key (the epoch) keeps peers of different epochs apart and stale declarations
        # of the previous round out of this one; the expected size lets the round start as soon as
        # every peer the progress records name is in
        result = await self.averager.astep(timeout=timeout, weight=weight, group_key=group_key,
                                           expected_size=expected_size)
        group = len(result.group)
        sent = self._estimate_bytes_sent(group)
        self.bytes_sent += sent
        return RoundResult(group, len(result.contributors), sent)

    def abandon_matchmaking(self, reason: str) -> bool:
        return self.averager.abandon_matchmaking(reason)

    async def aannounce(self, ready_in: float, group_key: str) -> bool:
        return await self.averager.aannounce(ready_in, group_key)

    def round_trip(self) -> float | None:
        """The smoothed round-trip time this peer measured to the others (None: nothing yet)."""
        return self.averager.peer.pool.estimates.rtt()

    def _estimate_bytes_sent(self, group_size: int) -> int:
        # butterfly all-reduce: a member sends the (n-1)/n of the vector it does not reduce, and
        # sends back the averaged part it reduced to the n-1 others: 2 (n-1)/n of the vector
        if group_size <= 1:
            return 0
        return int(2 * (group_size - 1) / group_size * self.numel * self.wire_bytes_per_element)

    async def ashutdown(self) -> None:
        await self.averager.ashutdown()


def make_swarm_averager(peer: PeerHandle, tensors: Sequence[torch.Tensor], prefix: str, config: CollaborationConfig,
                        compression: CompressionType) -> SwarmAverager:
    """A `swarm.Averager` of `peer` over `tensors`, grouping peers under `prefix`."""
    from swarm.averaging import AllReduceConfig, Averager, AveragerConfig, MatchmakingConfig

    numel = sum(t.numel() for t in tensors)
    settings = AveragerConfig(
        # each round's key is its epoch, so a round's group is most often the last one's: its
        # followers go straight to its leader, with no DHT declaration or read (`follow_last_leader`)
        matchmaking=MatchmakingConfig(target_group_size=config.target_group_size, min_group_size=2,
                                      join_window=config.matchmaking_window, follow_last_leader=True),
        compression=compression, allreduce=AllReduceConfig(aggregation=config.aggregation),
    )
    averager = Averager(peer, list(tensors), prefix=prefix, config=settings)
    wire = get_codec(compression).encoded_size(max(numel, 1)) / max(numel, 1)
    return SwarmAverager(averager, wire)
