"""Tests of swarm.moe.client.beam_search against brute force, without sockets (a static expert table)."""

from __future__ import annotations

import asyncio
import itertools
import math

import pytest
import torch

from swarm.moe.client.beam_search import MoEBeamSearcher
from swarm.moe.sources import StaticExpertSource
from swarm.moe.uids import format_uid

pytestmark = pytest.mark.timeout(30)


def table(alive: list[tuple[int, ...]], prefix: str = "ffn") -> dict[str, str]:
    return {format_uid(prefix, c): f"/ip4/127.0.0.1/tcp/{1000 + i}/p2p/X" for i, c in enumerate(alive)}


def brute_force(scores: list[torch.Tensor], alive: list[tuple[int, ...]], k: int) -> list[list[str]]:
    best = []
    for b in range(scores[0].shape[0]):
        ranked = sorted(alive, key=lambda c: -sum(float(s[b, i]) for s, i in zip(scores, c)))
        best.append([format_uid("ffn", c) for c in ranked[:k]])
    return best


def chosen_uids(choice, k: int) -> list[list[str]]:
    return [
        [choice.experts[int(choice.codes[b, j])][0] for j in range(k) if choice.valid[b, j]]
        for b in range(choice.codes.shape[0])
    ]


@pytest.mark.parametrize("grid", [(4,), (4, 4), (3, 5, 2)])
def test_full_beam_finds_the_exact_top_k_of_the_live_experts(grid: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(grid))
    cells = list(itertools.product(*map(range, grid)))
    alive = [c for c in cells if torch.rand((), generator=gen) < 0.6]
    scores = [torch.randn(16, g, generator=gen) for g in grid]
    k = 3
    # a beam as wide as the grid makes beam search exact
    searcher = MoEBeamSearcher(StaticExpertSource(table(alive)), "ffn.", grid)
    choice = asyncio.run(searcher.find_best_experts(scores, k, beam_size=math.prod(grid)))
    assert chosen_uids(choice, k) == brute_force(scores, alive, k)
    for d in range(len(grid)):  # coords decode to the chosen uids
        for b in range(16):
            for j in range(k):
                if choice.valid[b, j]:
                    uid = choice.experts[int(choice.codes[b, j])][0]
                    assert int(uid.split(".")[1 + d]) == int(choice.coords(d)[b, j])


def test_narrow_beam_returns_live_experts_in_score_order() -> None:
    grid = (8, 8)
    alive = [(i, j) for i in range(8) for j in range(8) if (i + j) % 3]
    scores = [torch.randn(32, 8), torch.randn(32, 8)]
    searcher = MoEBeamSearcher(StaticExpertSource(table(alive)), "ffn", grid)
    choice = asyncio.run(searcher.find_best_experts(scores, 4))
    live = {format_uid("ffn", c) for c in alive}
    for b, uids in enumerate(chosen_uids(choice, 4)):
        assert len(uids) == 4 and set(uids) <= live and len(set(uids)) == 4
        totals = [sum(float(s[b, int(c)]) for s, c in zip(scores, u.split(".")[1:])) for u in uids]
        assert totals == sorted(totals, reverse=True)


def test_fewer_live_experts_than_k_are_marked_invalid_and_nothing_alive_is_empty() -> None:
    searcher = MoEBeamSearcher(StaticExpertSource(table([(1, 0)])), "ffn.", (2, 2))
    choice = asyncio.run(searcher.find_best_experts([torch.randn(3, 2), torch.randn(3, 2)], 4))
    assert choice.codes.shape == (3, 4) and choice.valid.sum(dim=1).tolist() == [1, 1, 1]
    assert [u for u, _ in choice.experts.values()] == ["ffn.1.0"]
    empty = MoEBeamSearcher(StaticExpertSource({}), "ffn.", (2, 2))
    choice = asyncio.run(empty.find_best_experts([torch.randn(3, 2), torch.randn(3, 2)], 2))
    assert not choice.valid.any() and choice.experts == {}


def test_excluded_experts_are_skipped_and_answers_are_cached() -> None:
    alive = [(i, j) for i in range(4) for j in range(4)]
    searcher = MoEBeamSearcher(StaticExpertSource(table(alive)), "ffn.", (4, 4), cache_ttl=60)
    scores = [torch.tensor([[9.0, 0, 0, 0]]), torch.tensor([[9.0, 1, 0, 0]])]

    async def main() -> None:
        first = await searcher.find_best_experts(scores, 1)
        assert first.experts[int(first.codes[0, 0])][0] == "ffn.0.0"
        reads = searcher.source_reads
        searcher.exclude("ffn.0.0", 60)
        second = await searcher.find_best_experts(scores, 1)
        assert second.experts[int(second.codes[0, 0])][0] == "ffn.0.1"
        for _ in range(5):
            await searcher.find_best_experts(scores, 1)
        assert searcher.source_reads == reads  # every later search was answered from the cache
        searcher.invalidate()
        await searcher.find_best_experts(scores, 1)
        assert searcher.source_reads > reads

    asyncio.run(main())


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="invalid expert prefix"):
        MoEBeamSearcher(StaticExpertSource({}), "1bad.", (2,))
    with pytest.raises(ValueError, match="grid_size"):
        MoEBeamSearcher(StaticExpertSource({}), "ffn.", (0, 2))
    searcher = MoEBeamSearcher(StaticExpertSource({}), "ffn.", (2, 2))
    with pytest.raises(ValueError, match="score tensor per grid dimension"):
        asyncio.run(searcher.find_best_experts([torch.randn(3, 2)], 1))
