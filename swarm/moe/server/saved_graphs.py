"""Forward passes an expert keeps for the backward call that follows them.

A remote expert's backward must produce gradients w.r.t. its inputs and parameters. Recomputing
the forward for it (what hivemind does) costs a whole extra forward, ~1/3 of a training step.
Instead, a forward that runs alone in its batch and carries a graph id is computed with autograd
on, and its graph is kept here under (caller, graph id). The backward with that id reuses it
when it is still valid: the expert took no optimizer step since (an in-place step would make
autograd refuse the graph anyway) and the backward's inputs are the forward's. Otherwise the
backward recomputes, as before.

Memory is bounded: at most `max_rows` rows of saved forwards per expert (oldest evicted first),
entries older than `ttl` seconds are dropped, and every entry dies at the expert's next step.
Only the batches of its expert touch a `SavedGraphs`, and the runtime never runs two of them at
once (`swarm.moe.server.runtime`: one group per expert), so it has no lock.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from cachetools import TLRUCache

__all__ = ["SavedForward", "SavedGraphs"]


@dataclass(frozen=True)
class SavedForward:
    """One forward pass kept with its graph.

    Attributes:
        inputs: the inputs, as leaves that require grad where they can.
        outputs: the outputs, still attached to the graph.
        version: the expert's update count when the forward ran.
        rows: the batch size.
        created: monotonic time of the forward.
    """

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    version: int
    rows: int
    created: float

    def matches(self, inputs: Sequence[torch.Tensor], version: int) -> bool:
        """Whether a backward with these inputs, at this expert version, may reuse the graph."""
        return (
            version == self.version
            and len(inputs) == len(self.inputs)
            and all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(inputs, self.inputs))
        )


class SavedGraphs:
    """Bounded store of `SavedForward`s, keyed by (caller, graph id): a cachetools `TLRUCache`
    whose size is counted in rows and whose entries expire `ttl` after their forward ran.

    Args:
        max_rows: the most rows of saved forwards kept at once (0 disables saving).
        ttl: seconds after which a saved forward is dropped.
    """

    def __init__(self, max_rows: int, ttl: float) -> None:
        if max_rows < 0 or not ttl > 0:
            raise ValueError(f"max_rows must be >= 0 and ttl > 0, got {max_rows!r}, {ttl!r}")
        self.max_rows = max_rows
        self.ttl = ttl
        # evicts the least recently used entries past max_rows, and expired ones first
        self._entries: TLRUCache[Hashable, SavedForward] = TLRUCache(
            maxsize=max_rows, ttu=lambda _key, saved, _now: saved.created + ttl, timer=time.monotonic,
            getsizeof=lambda saved: saved.rows)
        self.hits = 0
        """Backwards that reused a saved graph."""
        self.misses = 0
        """Backwards that asked for a graph and had to recompute."""

    def __len__(self) -> int:
        self._entries.expire()
        return len(self._entries)

    @property
    def rows(self) -> int:
        """Rows held now."""
        self._entries.expire()
        return int(self._entries.currsize)

    def accepts(self, rows: int) -> bool:
        """Whether a forward of `rows` rows may be saved at all."""
        return 0 < rows <= self.max_rows

    def put(self, key: Hashable, saved: SavedForward) -> None:
        """Keeps `saved`, evicting expired, then least recently used, entries to stay within `max_rows`."""
        if self.accepts(saved.rows):
            self._entries[key] = saved

    def pop(self, key: Hashable) -> SavedForward | None:
        """Removes and returns the entry under `key` (None if absent or expired)."""
        return self._entries.pop(key, None)

    def invalidate_before(self, version: int) -> None:
        """Drops every entry computed before the expert's update `version` (useless now)."""
        for key in [k for k, s in self._entries.items() if s.version < version]:
            del self._entries[key]

    def clear(self) -> None:
        self._entries.clear()
