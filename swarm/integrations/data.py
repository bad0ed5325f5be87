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
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        self.num_samples = num_samples
        self.seed = seed
        self.passes = 0  # complete passes over the dataset
        self.offset = 0  # indices handed out in the current pass

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed + self.passes) % (1 << 63))
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[int]:
        while True:
            order = self._order()
            while self.offset < self.num_samples:
                index = int(order[self.offset])
                self.offset += 1
                yield index
            self.passes += 1
            self.offset = 0

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
