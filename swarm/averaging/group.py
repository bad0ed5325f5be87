"""An averaging group: who takes part in one round, in which role, and who leads.

Pure data, fixed by the leader when the group forms (matchmaking) and identical on every member.
Roles follow from each member's declaration:

- *reducers* are the members that accept connections (not client mode), auxiliary ones included;
  reducer j owns part j of the flat vector (possibly empty when its bandwidth is 0);
- *senders* are the members that hold tensors (not auxiliary); they send part j to reducer j
  and get the averaged part back on the same stream, so client-mode members take part too;
- the *leader* is ``members[0]``; it must accept connections.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.core.errors import ConfigError
from swarm.core.multiaddr import is_relayed
from swarm.proto import averaging_pb2


@dataclass(frozen=True)
class MemberInfo:
    """One member of a group, as it declared itself when joining.

    Attributes:
        peer_id: the member's PeerID.
        addr: a multiaddr others can dial; empty for client-mode members.
        weight: weight of this member's tensors in the mean; 0 makes it a listener.
        bandwidth: relative network bandwidth; part sizes are proportional to it among reducers.
        client_mode: the member only dials out; it sends and receives but reduces nothing.
        auxiliary: the member has no tensors and only helps reduce.
    """

    peer_id: str
    addr: str = ""
    weight: float = 1.0
    bandwidth: float = 1.0
    client_mode: bool = False
    auxiliary: bool = False

    def __post_init__(self) -> None:
        if not self.peer_id:
            raise ConfigError("a group member needs a peer id")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ConfigError(f"member weight must be finite and >= 0, got {self.weight}")
        if not (math.isfinite(self.bandwidth) and self.bandwidth >= 0):
            raise ConfigError(f"member bandwidth must be finite and >= 0, got {self.bandwidth}")
        if self.client_mode and self.auxiliary:
            raise ConfigError("a client-mode member cannot be auxiliary: it would neither reduce nor send")
        if not self.client_mode and not self.addr:
            raise ConfigError(f"member {self.peer_id} accepts connections but declared no address")
        if self.auxiliary and self.weight != 0:
            raise ConfigError("an auxiliary member has no tensors, so its weight must be 0")

    @property
    def is_reducer(self) -> bool:
        return not self.client_mode

    @property
    def is_sender(self) -> bool:
        return not self.auxiliary

    def to_proto(self) -> averaging_pb2.AvgMember:
        return averaging_pb2.AvgMember(
            peer_id=self.peer_id, addr=self.addr, weight=self.weight, bandwidth=self.bandwidth,
            client_mode=self.client_mode, auxiliary=self.auxiliary,
        )

    @classmethod
    def from_proto(cls, msg: averaging_pb2.AvgMember) -> MemberInfo:
        return cls(msg.peer_id, msg.addr, msg.weight, msg.bandwidth, msg.client_mode, msg.auxiliary)


@dataclass(frozen=True)
class GroupInfo:
    """Everything the members of one round share.

    Attributes:
        round_id: unique id of the round (random bytes chosen by the leader).
        prefix: the averager's prefix (several averagers may share a peer).
        members: ordered members; ``members[0]`` leads.
        numel: length of the flat vector every member averages.
        timeout: seconds the all-reduce may take, counted from when a member receives the group.
        compression: wire codec (`swarm.compression.CompressionType` value).
        chunk_bytes: target size of one stream message.
        schema: digest of the tensors' shapes and dtypes (members must agree).
    """

    round_id: bytes
    prefix: str
    members: tuple[MemberInfo, ...]
    numel: int
    timeout: float
    compression: int = 0
    chunk_bytes: int = 1 << 20
    schema: bytes = b""

    def __post_init__(self) -> None:
        if not self.round_id:
            raise ConfigError("a group needs a round id")
        if not self.members:
            raise ConfigError("a group needs members")
        ids = [m.peer_id for m in self.members]
        if len(set(ids)) != len(ids):
            raise ConfigError("a peer appears twice in the group")
        if self.members[0].client_mode:
            raise ConfigError("the leader (members[0]) must accept connections")
        if self.numel < 0 or self.timeout <= 0 or self.chunk_bytes < 1024:
            raise ConfigError("group needs numel >= 0, timeout > 0 and chunk_bytes >= 1024")
        if not any(m.is_sender for m in self.members):
            raise ConfigError("a group needs at least one member with tensors")

    @property
    def leader(self) -> MemberInfo:
        return self.members[0]

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(m.peer_id for m in self.members)

    @property
    def reducers(self) -> list[int]:
        """Member indices of the reducers; part j belongs to ``reducers[j]``."""
        return [i for i, m in enumerate(self.members) if m.is_reducer]

    @property
    def senders(self) -> list[int]:
        return [i for i, m in enumerate(self.members) if m.is_sender]

    def index_of(self, peer_id: str) -> int:
        for i, m in enumerate(self.members):
            if m.peer_id == peer_id:
                return i
        raise KeyError(peer_id)

    def part_of(self, member_index: int) -> int | None:
        """The part a member reduces, or None for client-mode members."""
        reducers = self.reducers
        return reducers.index(member_index) if member_index in reducers else None

    def to_proto(self) -> averaging_pb2.AvgGroup:
        return averaging_pb2.AvgGroup(
            round_id=self.round_id, prefix=self.prefix, members=[m.to_proto() for m in self.members],
            timeout=self.timeout, numel=self.numel, compression=self.compression,
            chunk_bytes=self.chunk_bytes, schema=self.schema,
        )

    @classmethod
    def from_proto(cls, msg: averaging_pb2.AvgGroup) -> GroupInfo:
        return cls(
            round_id=msg.round_id, prefix=msg.prefix,
            members=tuple(MemberInfo.from_proto(m) for m in msg.members), numel=msg.numel,
            timeout=msg.timeout, compression=msg.compression, chunk_bytes=msg.chunk_bytes, schema=msg.schema,
        )


def cap_relayed_parts(members: Sequence[MemberInfo]) -> tuple[MemberInfo, ...]:
    """The members as a leader puts them in its group: a reducer reached through a relay gets a
    bandwidth no larger than the smallest direct reducer's, so it never reduces a larger part than
    a peer reached directly (docs/relay.md); unchanged when no direct reducer declares any bandwidth.

    Every member uses the group the leader sent, so the partition stays the same on all of them.
    """
    direct = [m.bandwidth for m in members if m.is_reducer and not is_relayed(m.addr) and m.bandwidth > 0]
    if not direct:
        return tuple(members)
    ceiling = min(direct)
    return tuple(dataclasses.replace(m, bandwidth=ceiling) if m.is_reducer and is_relayed(m.addr)
                 and m.bandwidth > ceiling else m for m in members)
