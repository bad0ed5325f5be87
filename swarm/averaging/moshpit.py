"""Group keys for Moshpit SGD: which peers average together in which round.

`moshpit_group_key` gives Moshpit SGD's group keys (Ryabinin et al., 2021, §3.2): peers sit in a
virtual grid and, in round t, group with the peers that share all their coordinates except
coordinate t mod d, so hundreds of peers form many small groups that mix across rounds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


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
