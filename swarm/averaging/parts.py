"""A member's view of one round's parts: how the vector is split, and where each part stands.

Pure bookkeeping shared by the all-reduce (`allreduce`) and its part recovery (`allreduce.fetch_part`).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

import torch

from swarm.averaging.group import GroupInfo
from swarm.averaging.partition import part_offsets, part_sizes
from swarm.core.errors import AveragingError
from swarm.proto import averaging_pb2

if TYPE_CHECKING:
    from swarm.net.bulk import Sink


class RoundFailed(AveragingError):
    """An averaging round failed; `round_id` and `reason` say which and why."""

    def __init__(self, round_id: bytes, reason: str) -> None:
        super().__init__(f"averaging round {round_id.hex()[:12]} failed: {reason}")
        self.round_id = round_id
        self.reason = reason


class PartState(enum.Enum):
    PENDING = "pending"
    COMPLETE = "complete"
    FAILED = "failed"      # its stream broke: fetch it from another member
    LOST = "lost"          # no one could provide it
    ABORTED = "aborted"    # its reducer aborted the round


@dataclass
class Part:
    index: int
    start: int
    size: int
    reducer: int                 # member index
    state: PartState = PartState.PENDING
    decision: bytes = b""
    reason: str = ""
    values: torch.Tensor | None = None  # where the averaged part lands
    received: int = 0
    fetch: asyncio.Task[None] | None = None
    last_progress: float = 0.0
    exchange: asyncio.Task[None] | None = None
    sink: Sink | None = None  # receives the averaged part straight into `values`
    claim: averaging_pb2.ResultHeader | None = None  # the header it came with (robust mode and verification read its fields)
    resolved: asyncio.Event = field(default_factory=asyncio.Event)  # complete, lost or aborted
    settled: asyncio.Event = field(default_factory=asyncio.Event)   # no longer pending


class ClaimFields(TypedDict, total=False):
    """The robust and verification fields of a part's `ResultHeader` (none in plain mode)."""

    clip_scales: Sequence[float]
    clip_tau: float
    clip_step: float
    digest: bytes
    sketches: Sequence[float]
    distances: Sequence[float]


def plan_parts(group: GroupInfo) -> tuple[list[int], list[int]]:
    """(sizes, offsets) of the parts, identical on every member."""
    sizes = part_sizes(group.numel, [group.members[i].bandwidth for i in group.reducers])
    return sizes, part_offsets(sizes)


def scratch_numel(group: GroupInfo, my_index: int) -> int:
    """Elements of the buffer one round needs here: reducer slots, then (reusing it) results."""
    sizes, _ = plan_parts(group)
    part = group.part_of(my_index)
    own = sizes[part] if part is not None else 0
    remote_senders = sum(1 for i in group.senders if i != my_index)
    slots = remote_senders * own if part is not None else 0
    results = group.numel - own if group.members[my_index].is_sender else 0
    return max(slots, results) + own  # the running sum (then the mean) of our own part last
