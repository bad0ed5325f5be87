"""Group keys for Moshpit SGD: which peers average together in which round.

`moshpit_group_key` gives Moshpit SGD's group keys (Ryabinin et al., 2021, §3.2): peers sit in a
virtual grid and, in round t, group with the peers that share all their coordinates except
coordinate t mod d, so hundreds of peers form many small groups that mix across rounds.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from swarm.averaging.parts import RoundFailed
from swarm.dht.handle import KeyValueStore
from swarm.dht.validation import marker_owner, owner_marker

if TYPE_CHECKING:
    from swarm.averaging.averager import Averager
    from swarm.averaging.round import AveragingResult


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


def row_weight(contributors: int, rows: int, base: float = 1e-6, floor: float = 1e-30) -> float:
    """A peer's weight when its row meets again after a round of one member of every row.

    A group that held `contributors` of the `rows` rows weighs ``base ** (rows - contributors)``:
    every peer from a group that held all rows (weight 1) outweighs the others, and where none did
    (a whole row died), the groups that held the most rows (all of them the same rows, so the same
    mean) outweigh the rest in turn; never 0, so a row of only incomplete peers still averages.
    """
    missing = max(0, rows - contributors)
    return max(floor, base ** missing)


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


# -- retrying a round whose all-reduce failed ---------------------------------------------------
#
# A member that dies inside a round fails its group's all-reduce, and a failed all-reduce applies
# nothing on any member (`Averager.step`: "the tensors are untouched"). Its survivors can therefore
# average again among themselves within the same step's time, so a death costs time, not a round.
# The retry runs under a key derived from the grid key and the failed round's id, which every
# survivor of that group (and no one else) knows: the grid key itself still holds the failed
# attempt's withdrawn declarations, which name the failed round as this key's group that started
# (a step under a key that names one round reads that as "my round's group started without me"),
# and a new declaration with the step's unchanged deadline would not outlast them.


def retry_key(group_key: str, failed_round: bytes) -> str:
    """Group key for the survivors of the failed round `failed_round` under `group_key`."""
    return f"{group_key}.retry.{failed_round.hex()[:16]}"


async def astep_retrying(averager: Averager, timeout: float, weight: float = 1.0, group_key: str | None = None,
                         expected_size: int | None = None, min_left: float = 2.0,
                         attempts: int = 3) -> AveragingResult:
    """`Averager.astep`, retried by the survivors of a group whose all-reduce failed.

    Args:
        averager: the peer's averager (a DHT group: a static group has no one else to retry with).
        timeout: seconds for the whole step, retries included.
        weight, expected_size: as for `Averager.astep` (the first attempt's `expected_size` only;
            a retry does not know how many survived).
        group_key: the round's group key (None: the averager's current one).
        min_left: a retry starts only with at least this many seconds of the step left.
        attempts: at most this many attempts in all.

    Returns:
        The result of the attempt that succeeded; `result.round_id` names the retry's round.

    Raises:
        AveragingError: no group formed (not retried: it applied nothing either, but its peers
            moved on), or the last attempt's round failed; the tensors are untouched.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    election = averager.matchmaking.election
    # a fixed (static) group meets under no key: its survivors have no other group to retry in
    base = group_key if group_key is not None else (None if election.fixed else election.group_key)
    key, size = group_key, expected_size
    for attempt in range(1, attempts + 1):
        try:
            return await averager.astep(timeout=deadline - loop.time(), weight=weight, group_key=key,
                                        expected_size=size)
        except RoundFailed as e:
            if base is None or attempt == attempts or deadline - loop.time() < min_left:
                raise
            key, size = retry_key(base, e.round_id), None
    raise AssertionError("unreachable")  # the loop returns or raises
