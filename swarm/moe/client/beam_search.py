"""Beam search over the expert grid: for every sample, the k best experts that are alive.

An expert ``prefix.c1.c2...cd`` scores ``s_1[c1] + s_2[c2] + ... + s_d[cd]``, one gating score
per grid dimension (Learning@home, Ryabinin & Gusev 2020, §3.1). The search walks the grid one
dimension at a time: it keeps, per sample, the `beam_size` best live prefixes, and asks the
`ExpertSource` which coordinates follow each of them (one DHT read per prefix, shared by every
sample whose beam holds it). All samples advance together with tensor ops; prefixes are integer
codes (mixed radix over the grid), turned into strings only for the source.

The answers are cached for `cache_ttl` seconds, so a training loop that calls the mixture many
times a second costs the DHT a handful of reads per `cache_ttl`, not per batch. Experts that just
failed can be excluded for a while (`exclude`), so the next batches choose live ones instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarm.moe.sources import ExpertSource
from swarm.moe.uids import UID_DELIMITER, Successors, is_valid_prefix

__all__ = ["ExpertChoice", "MoEBeamSearcher"]


@dataclass(frozen=True)
class ExpertChoice:
    """The experts chosen for a batch.

    Attributes:
        codes: ``(batch, k)`` grid codes of the chosen experts, best first (0 where invalid).
        valid: ``(batch, k)`` whether each slot holds an expert (fewer may be alive than k).
        experts: grid code -> (uid, address) of every chosen expert.
        grid_size: the grid, to decode codes into coordinates.
    """

    codes: torch.Tensor
    valid: torch.Tensor
    experts: dict[int, tuple[str, str]]
    grid_size: tuple[int, ...]

    def coords(self, dim: int) -> torch.Tensor:
        """``(batch, k)`` coordinate of each chosen expert along grid dimension `dim`."""
        stride = math.prod(self.grid_size[dim + 1:])
        return (self.codes // stride) % self.grid_size[dim]


class MoEBeamSearcher:
    """Finds the best live experts of one grid.

    Args:
        source: where live experts are found (the DHT, or a static table).
        uid_prefix: the grid's prefix, e.g. ``"ffn."`` (a trailing delimiter is added if missing).
        grid_size: the number of coordinates along each dimension, e.g. ``(4, 4)``.
        cache_ttl: seconds a prefix's successors are reused before the source is asked again.

    Raises:
        ValueError: an invalid prefix or grid.
    """

    def __init__(
        self, source: ExpertSource, uid_prefix: str, grid_size: Sequence[int], cache_ttl: float = 2.0
    ) -> None:
        if not uid_prefix.endswith(UID_DELIMITER):
            uid_prefix += UID_DELIMITER
        if not is_valid_prefix(uid_prefix):
            raise ValueError(f"invalid expert prefix {uid_prefix!r}")
        if not grid_size or any(not isinstance(g, int) or g < 1 for g in grid_size):
            raise ValueError(f"grid_size must be positive ints, got {tuple(grid_size)!r}")
        if cache_ttl < 0:
            raise ValueError("cache_ttl must be >= 0")
        self.source = source
        self.uid_prefix = uid_prefix
        self.grid_size = tuple(grid_size)
        self.cache_ttl = cache_ttl
        self._cache: dict[str, tuple[float, Successors]] = {}
        self._excluded: dict[str, float] = {}
        self._avoided_servers: dict[str, float] = {}
        self.source_reads = 0
        """Prefixes read from the source so far (cache misses)."""

    def exclude(self, uid: str, seconds: float) -> None:
        """Does not choose expert `uid` for the next `seconds` (it just failed)."""
        self._excluded[uid] = time.monotonic() + seconds

    def avoid_server(self, addr: str, seconds: float) -> None:
        """Chooses none of the experts of the server at `addr` for the next `seconds` (it misbehaved)."""
        self._avoided_servers[addr] = time.monotonic() + seconds

    def avoided_servers(self) -> list[str]:
        """The servers avoided now (`avoid_server`)."""
        now = time.monotonic()
        return [addr for addr, until in self._avoided_servers.items() if until > now]

    def invalidate(self) -> None:
        """Forgets cached answers, so the next search asks the source again."""
        self._cache.clear()

    def _prefix(self, code: int, depth: int) -> str:
        coords = []
        for g in reversed(self.grid_size[:depth]):
            code, c = divmod(code, g)
            coords.append(str(c))
        return self.uid_prefix + "".join(c + UID_DELIMITER for c in reversed(coords))

    async def _successors(self, prefixes: list[str]) -> dict[str, Successors]:
        now = time.monotonic()
        found = {p: hit[1] for p in prefixes if (hit := self._cache.get(p)) and now - hit[0] <= self.cache_ttl}
        missing = [p for p in prefixes if p not in found]
        if missing:
            answer = await self.source.get_successors(missing)
            self.source_reads += len(missing)
            for prefix in missing:
                found[prefix] = answer.get(prefix) or {}
                self._cache[prefix] = (now, found[prefix])
        return found

    async def find_best_experts(self, grid_scores: Sequence[torch.Tensor], k: int, beam_size: int | None = None) -> ExpertChoice:
        """Chooses up to `k` live experts per sample, best total score first.

        Args:
            grid_scores: one ``(batch, grid_size[i])`` score tensor per grid dimension.
            k: experts per sample.
            beam_size: prefixes kept per sample at each level (default `k`).

        Returns:
            The choice; slots without a live expert are marked invalid.

        Raises:
            ValueError: scores that do not match the grid.
        """
        if len(grid_scores) != len(self.grid_size) or any(
            s.dim() != 2 or s.shape[1] != g or s.shape[0] != grid_scores[0].shape[0]
            for s, g in zip(grid_scores, self.grid_size)
        ):
            raise ValueError(f"expected one (batch, g) score tensor per grid dimension {self.grid_size}")
        beam_size = max(beam_size or k, k)
        batch = grid_scores[0].shape[0]
        now = time.monotonic()
        self._excluded = {u: t for u, t in self._excluded.items() if t > now}
        self._avoided_servers = {a: t for a, t in self._avoided_servers.items() if t > now}
        codes = torch.zeros(batch, 1, dtype=torch.long)
        scores = torch.zeros(batch, 1)
        valid = torch.ones(batch, 1, dtype=torch.bool)
        experts: dict[int, tuple[str, str]] = {}
        depth = len(self.grid_size)
        for level, g in enumerate(self.grid_size):
            last = level == depth - 1
            if not bool(valid.any()):  # nothing alive under any beam: no expert for anyone
                return ExpertChoice(
                    torch.zeros(batch, k, dtype=torch.long), torch.zeros(batch, k, dtype=torch.bool), {}, self.grid_size
                )
            filler = codes[valid][0]  # invalid slots reuse a live prefix, so they cost no extra read
            unique, inverse = torch.unique(torch.where(valid, codes, filler), return_inverse=True)
            prefixes = [self._prefix(int(c), level) for c in unique.tolist()]
            successors = await self._successors(prefixes)
            alive = torch.zeros(len(prefixes), g, dtype=torch.bool)
            for row, prefix in enumerate(prefixes):
                for coord, (uid, addr) in successors.get(prefix, {}).items():
                    if not 0 <= coord < g or (last and (uid in self._excluded or addr in self._avoided_servers)):
                        continue
                    alive[row, coord] = True
                    if last:
                        experts[int(unique[row]) * g + coord] = (uid, addr)
            candidates = scores.unsqueeze(2) + grid_scores[level].detach().float().unsqueeze(1)
            mask = alive[inverse] & valid.unsqueeze(2)
            candidates = candidates.masked_fill(~mask, -math.inf).flatten(1)
            width = min(k if last else beam_size, candidates.shape[1])
            top_scores, top_index = candidates.topk(width, dim=1)
            parents, coords = top_index // g, top_index % g
            codes = codes.gather(1, parents) * g + coords
            scores, valid = top_scores, torch.isfinite(top_scores)
            codes = codes.masked_fill(~valid, 0)
        if codes.shape[1] < k:  # a grid smaller than k: pad with invalid slots
            pad = k - codes.shape[1]
            codes = torch.cat([codes, torch.zeros(batch, pad, dtype=torch.long)], dim=1)
            valid = torch.cat([valid, torch.zeros(batch, pad, dtype=torch.bool)], dim=1)
        used = set(codes[valid].tolist())
        return ExpertChoice(codes, valid, {c: e for c, e in experts.items() if c in used}, self.grid_size)
