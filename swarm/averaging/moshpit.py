"""Group keys for Moshpit SGD: which peers average together in which round.

`moshpit_group_key` gives Moshpit SGD's group keys (Ryabinin et al., 2021, §3.2): peers sit in a
virtual grid and, in round t, group with the peers that share all their coordinates except
coordinate t mod d, so hundreds of peers form many small groups that mix across rounds.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable, Sequence

from swarm.dht.handle import KeyValueStore
from swarm.dht.validation import marker_owner, owner_marker


def moshpit_group_key(round_number: int, coords: Sequence[int]) -> str:
    """Moshpit SGD group key: in round t, peers that share every grid coordinate except t mod d.

    Args:
        round_number: the averaging round (the same on every peer, e.g. the training epoch).
        coords: this peer's coordinates in the virtual grid (d = len(coords)).

    Returns:
        A key naming the dimension averaged this round and the other coordinates.
    """
    if not coords:
        return "0"
    dim = round_number % len(coords)
    rest = ".".join(str(c) for i, c in enumerate(coords) if i != dim)
    return f"d{dim}.{rest}" if rest else f"d{dim}"


def moshpit_next_coords(round_number: int, coords: Sequence[int], index_in_group: int, grid: Sequence[int]) -> list[int]:
    """After a round, a peer's coordinate along the averaged dimension becomes its index in the group,
    so the members of one group spread to different groups in the next rounds (Moshpit §3.2)."""
    if len(coords) != len(grid):
        raise ValueError("coords and grid must have the same length")
    new = list(coords)
    dim = round_number % len(coords)
    new[dim] = index_in_group % grid[dim]
    return new


def random_coords(grid: Sequence[int], rng: random.Random | None = None) -> list[int]:
    rng = rng or random.Random()
    return [rng.randrange(size) for size in grid]


# -- regrouping after deaths between rounds ----------------------------------------------------
#
# After a round on a full grid, the survivors of one group (a "row") all hold that group's mean
# c_i. When peers died after that round and before the next one's matchmaking, the next round can
# still give the survivors' exact mean m = sum_i n_i c_i / sum_i n_i (n_i: row i's survivors) in
# one round: each row's survivors number themselves 0..n_i-1 by PeerID, the k-th survivor of every
# row meets the others under `regroup_key(round, k)` with weight n_i, and a group that holds one
# survivor of every row (a "complete" group) outputs m exactly. Survivors numbered past the
# smallest row (no complete group) take m in the round after: every row meets again under
# `row_key`, complete-group peers with weight 1 and the others with weight 0.
# Every peer derives its number and weight from the same DHT records (`RowRoll`): no coordinator.


def regroup_key(round_number: int, rank: int) -> str:
    """Group key for the round after deaths: the `rank`-th survivor of every row meet."""
    return f"r{round_number}.k{rank}"


def row_key(round_number: int, row: str) -> str:
    """Group key for the row `row` (the round id of the group its peers shared) meeting again."""
    return f"r{round_number}.row.{row}"


def survivor_rank(peer_id: str, survivors: Iterable[str]) -> tuple[int, int]:
    """(this peer's number among its row's survivors by PeerID, how many survivors the row has)."""
    ordered = sorted(set(survivors) | {peer_id})
    return ordered.index(peer_id), len(ordered)


class RowRoll:
    """The roll call of one row in the DHT: who of a group's members is still there.

    Every survivor stores itself under ``{prefix}.roll.{row}`` (subkey: its owner marker, so no one
    else can write or forge its entry), waits `settle` seconds for the others, and reads the roll;
    only entries of the row's own members (`members`) count.

    Args:
        dht: the peer's `swarm.dht` handle (``astore`` / ``aget``).
        prefix: the averager's prefix.
        row: the round id (hex) of the group the row's members shared.
        members: the PeerIDs of that group.
    """

    def __init__(self, dht: KeyValueStore, prefix: str, row: str, members: Iterable[str]) -> None:
        self.dht, self.key, self.members = dht, f"{prefix}.roll.{row}", frozenset(members)

    async def call(self, peer_id: str, settle: float, expiration: float) -> list[str]:
        """Stores this peer in the roll, waits `settle` s, returns the survivors (sorted PeerIDs)."""
        await self.dht.astore(self.key, True, expiration_time=expiration, subkey=owner_marker(peer_id))
        await asyncio.sleep(settle)
        found = await self.dht.aget(self.key, latest=True)
        present = {peer_id}
        if found is not None and isinstance(found.value, dict):
            for subkey in found.value:
                owner = marker_owner(subkey)
                if owner in self.members:
                    present.add(owner)
        return sorted(present)
