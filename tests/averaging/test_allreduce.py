"""All-reduce on in-process peers: compression bounds, NaN rejection, listeners, the awaitable form."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from avg_harness import run_steps

from swarm.averaging import AllReduceConfig, Averager, AveragerConfig
from swarm.compression import CompressionType
from swarm.core.errors import AveragingError
from swarm.metrics import REGISTRY
from swarm.peer import Peer


@pytest.fixture
def peers():
    made: list[Peer] = []

    def make(n: int, clients: int = 0) -> list[Peer]:
        made.extend(Peer(client_mode=i >= n - clients) for i in range(n))
        return made[-n:]

    yield make
    for p in made:
        p.shutdown()


def make_averagers(peers: list[Peer], tensors: list[list[torch.Tensor]], **kwargs: Any) -> list[Averager]:
    addrs = [p.addrs[0] for p in peers if p.addrs]
    return [Averager(p, t, prefix="t", target_group_size=len(peers), initial_group=addrs, **kwargs)
            for p, t in zip(peers, tensors)]


# relative error bound of each codec on values of order 1 (the codecs' documented bounds)
CODEC_BOUNDS = {
    CompressionType.NONE: 1e-6,
    CompressionType.FLOAT16: 2.0**-10,
    CompressionType.SCALED_FLOAT16: 2.0**-10,
    CompressionType.UNIFORM_8BIT: 2 * 2.0 / 255,   # one quantization step of a chunk's range, twice
    CompressionType.QUANTILE_8BIT: 0.25,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(CODEC_BOUNDS))
def test_compressed_rounds_stay_within_codec_bounds_and_agree(peers, kind):
    group = peers(3, clients=1)
    gen = torch.Generator().manual_seed(int(kind))
    inputs = [torch.rand(20_000, generator=gen) * 2 - 1 for _ in range(3)]
    tensors = [[x.clone()] for x in inputs]
    config = AveragerConfig(compression=int(kind), allreduce=AllReduceConfig(chunk_bytes=16384))
    results = run_steps(make_averagers(group, tensors, config=config), [1.0, 2.0, 1.0])
    assert all(not isinstance(r, Exception) for r in results), results
    exact = (inputs[0] + 2 * inputs[1] + inputs[2]) / 4
    err = float((tensors[0][0] - exact).abs().max())
    assert err <= CODEC_BOUNDS[kind], f"{kind.name}: {err}"
    assert torch.equal(tensors[0][0], tensors[1][0]) and torch.equal(tensors[0][0], tensors[2][0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", [CompressionType.NONE, CompressionType.UNIFORM_8BIT])
def test_non_finite_input_is_rejected_and_reported_not_spread(peers, kind):
    group = peers(3)
    inputs = [torch.randn(5000) for _ in range(3)]
    inputs[1][1234] = float("inf")
    tensors = [[x.clone()] for x in inputs]
    config = AveragerConfig(compression=int(kind), allreduce=AllReduceConfig(chunk_bytes=4096))
    results = run_steps(make_averagers(group, tensors, config=config), [1.0, 1.0, 1.0])
    assert all(not isinstance(r, Exception) for r in results), results
    bad = group[1].peer_id
    assert bad not in results[0].contributors and len(results[0].contributors) == 2
    reason = results[0].excluded[bad]
    assert "non-finite" in reason or "cannot encode" in reason, reason
    for t in tensors:
        assert torch.isfinite(t[0]).all()
    tol = 1e-6 if kind == CompressionType.NONE else 0.1
    assert torch.allclose(tensors[0][0], (inputs[0] + inputs[2]) / 2, atol=tol)


@pytest.mark.timeout(60)
def test_listener_and_auxiliary_peers(peers):
    group = peers(4)
    inputs = [torch.randn(3000) for _ in range(4)]
    tensors = [[x.clone()] for x in inputs]
    addrs = [p.addrs[0] for p in group]
    avgs = [Averager(p, t, prefix="t", target_group_size=4, initial_group=addrs, auxiliary=(i == 3))
            for i, (p, t) in enumerate(zip(group, tensors))]
    results = run_steps(avgs, [1.0, 3.0, 0.0, 0.0])  # peer 2 only listens; peer 3 only reduces
    assert all(not isinstance(r, Exception) for r in results), results
    assert set(results[0].contributors) == {group[0].peer_id, group[1].peer_id}
    expected = (inputs[0] + 3 * inputs[1]) / 4
    for i in range(3):
        assert torch.allclose(tensors[i][0], expected, atol=1e-6)
    assert torch.equal(tensors[3][0], inputs[3])  # an auxiliary peer's tensors only give the shapes


@pytest.mark.timeout(60)
def test_astep_from_another_event_loop_and_bad_arguments(peers):
    a, b = peers(2)
    ta, tb = [torch.zeros(10)], [torch.ones(10)]
    avg_a, avg_b = make_averagers([a, b], [ta, tb])

    async def both() -> list[Any]:
        return await asyncio.gather(avg_a.astep(timeout=10), avg_b.astep(timeout=10))

    ra, rb = asyncio.run(both())
    assert ra.round_id == rb.round_id and torch.allclose(ta[0], torch.full((10,), 0.5))
    with pytest.raises(ValueError):
        avg_a.step(timeout=-1)
    with pytest.raises(ValueError):
        avg_a.step(timeout=1, weight=float("nan"))
    with pytest.raises(AveragingError):
        avg_a.step(timeout=0.5)  # b is not stepping: no group


@pytest.mark.timeout(60)
def test_every_member_keeps_its_bulk_connections_from_round_to_round(peers):
    """Each member dials each reducer once; later rounds start on the kept connections, also for
    the member that finishes a round last (it used to cancel its streams before the reducers'
    END came back and dial them all afresh next round: network lab, scenario 3)."""
    group = peers(3)
    tensors = [[torch.full((40_000,), float(i))] for i in range(3)]
    avgs = make_averagers(group, tensors, config=AveragerConfig(allreduce=AllReduceConfig(chunk_bytes=16384)))

    def count(how: str) -> float:
        return REGISTRY.value("swarm_bulk_connections_total", how=how) or 0.0

    dialed, reused = count("dialed"), count("reused")
    for _ in range(3):
        results = run_steps(avgs)
        assert all(not isinstance(r, Exception) for r in results), results
        for peer in group:  # the reducers' END comes back a round trip after the round
            assert peer.run(_kept_everywhere(peer, 2), timeout=10)
    assert count("dialed") - dialed == 6  # 3 members x 2 reducers, in the first round only
    assert count("reused") - reused == 12
    assert all(torch.equal(t[0], torch.full((40_000,), 1.0)) for t in tensors)


async def _kept_everywhere(peer: Peer, channels: int) -> bool:
    """Whether `peer` holds a kept bulk connection to each of `channels` peers within 5 s (a
    bounded wait: its streams of the last round end a round trip after the round)."""
    for _ in range(500):
        kept = [c for c in peer.pool._channels.values() if c._bulk_idle]
        if len(kept) == channels:
            return True
        await asyncio.sleep(0.01)
    return False


@pytest.mark.timeout(30)
def test_the_leaders_mean_waits_for_another_reducers_mean_to_start_arriving(peers, monkeypatch, caplog):
    # the leader decides first; its reducer holds its mean until another reducer's mean starts to
    # arrive (benchmarks/history/BENCHMARKS-2026-12-05.md scenario 3: a leader that sent at once got its own parts last). The cap
    # is set far beyond the test's bound, so the round ends only if the others' means release it.
    from swarm.averaging import reducer

    monkeypatch.setattr(reducer, "LEADER_HOLD_CAP", 600.0)
    caplog.set_level("DEBUG", logger="swarm.averaging.reducer")
    group = peers(3)
    inputs = [torch.full((50_000,), float(i)) for i in range(3)]
    tensors = [[x.clone()] for x in inputs]
    results = run_steps(make_averagers(group, tensors), [1.0, 1.0, 1.0])
    assert all(not isinstance(r, Exception) for r in results), results
    assert all(torch.equal(t[0], torch.full((50_000,), 1.0)) for t in tensors)
    held = [r for r in caplog.records if "the leader's mean goes out" in r.getMessage()]
    assert len(held) == 1, [r.getMessage() for r in held]  # one leader, one round
