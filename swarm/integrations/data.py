"""Each volunteer trains on its own part of the data, with no coordination, and never replays it.

`PeerShardSampler` draws the indices of a dataset in an order seeded by the peer's ID (its PeerID,
which a restarted peer keeps when it keeps its identity file): peers see the data in unrelated
orders, so at any moment they train on different samples, and each pass of one peer covers the
whole dataset once. The sampler never ends (a new pass starts with a fresh order); the trainer
stops at its step limit. Its position (pass and offset) is part of the integrations' checkpoint,
so a peer restarted from its checkpoint goes on where it stopped instead of training again on the
samples it already trained on.

Why not fixed shards (index hash modulo the number of peers): the number of peers changes as
volunteers come and go, and a shard assignment that follows it needs the coordination this avoids;
with independent orders, N peers cover the dataset N times faster than one, as the swarm's batch
is N times larger.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping

import torch


def peer_seed(peer_id: str, salt: str = "") -> int:
    """A 63-bit seed derived from a peer's ID (and an optional salt, such as the run's name)."""
    digest = hashlib.blake2b(f"{salt}/{peer_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class PeerShardSampler(torch.utils.data.Sampler[int]):
    """Endless indices of a dataset in an order of this peer's own; resumable.

    Args:
        num_samples: the dataset's length.
        seed: the order's seed (`peer_seed(peer.peer_id, run_id)`).
        rank, ranks: in a job of `ranks` local ranks that are one peer, this rank's share of the
            peer's order: the indices at positions `rank`, `rank + ranks`, ... of it. The
            position (`offset`, `passes`) counts the peer's order and moves a whole row of `ranks`
            positions per index: every rank of a job that takes batches of one size is at the
            same position, and a rank's saved position resumes any rank.
    """

    def __init__(self, num_samples: int, seed: int, rank: int = 0, ranks: int = 1) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        if not isinstance(ranks, int) or ranks < 1 or not isinstance(rank, int) or not 0 <= rank < ranks:
            raise ValueError(f"rank must be in [0, ranks) and ranks positive, got rank {rank!r} of {ranks!r}")
        self.num_samples = num_samples
        self.seed = seed
        self.rank, self.ranks = rank, ranks
        self.passes = 0  # complete passes over the dataset
        self.offset = 0  # positions of the peer's order passed in the current pass

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed + self.passes) % (1 << 63))
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[int]:
        order, drawn = self._order(), self.passes
        while True:
            if self.offset >= self.num_samples:  # a new pass, a new order
                self.passes, self.offset = self.passes + 1, self.offset - self.num_samples
                continue
            at = self.position
            if at % self.ranks != self.rank:  # another rank's position
                self.offset += 1
                continue
            if drawn != self.passes:
                order, drawn = self._order(), self.passes
            index = int(order[self.offset])
            self.offset += self.ranks - self.rank  # past the other ranks' positions of this row
            yield index

    @property
    def position(self) -> int:
        """Indices handed out so far, over all passes."""
        return self.passes * self.num_samples + self.offset

    def state_dict(self) -> dict[str, int]:
        return {"num_samples": self.num_samples, "seed": self.seed, "passes": self.passes, "offset": self.offset}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Resumes where a saved sampler stopped (same dataset length; the seed comes with the state).

        Raises:
            ValueError: the state is malformed or belongs to a dataset of another length.
        """
        num_samples, seed, passes, offset = (_saved_int(state, k) for k in ("num_samples", "seed", "passes", "offset"))
        if num_samples != self.num_samples:
            raise ValueError(f"the saved position is in a dataset of {num_samples} samples, this one has "
                             f"{self.num_samples}")
        if passes < 0 or not 0 <= offset <= num_samples:
            raise ValueError(f"bad sampler position: pass {passes}, offset {offset}")
        self.seed, self.passes, self.offset = seed, passes, offset


def _saved_int(state: Mapping[str, object], key: str) -> int:
    """`state[key]` if it is an int; ValueError (a malformed saved state, like the others) if not."""
    value = state.get(key) if isinstance(state, Mapping) else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"not a sampler state: {key} is {value!r}")
