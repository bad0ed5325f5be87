"""A part whose stream lags far behind a member's other parts has its tail fetched from another
holder (`allreduce.fetch_tail`), backwards, until it meets the stream: found in the network lab
(BENCHMARKS.md, scenario 3), where one reducer's flow to one member lagged up to 1.3 s behind the
others while every other member already held that part."""

from __future__ import annotations

import time

import pytest
import torch
from avg_harness import run_steps

from swarm.averaging import Action, AllReduceConfig, Averager, AveragerConfig, FaultPlan, FaultPoint
from swarm.averaging.allreduce import tail_bounds
from swarm.compression import CompressionType
from swarm.metrics import REGISTRY
from swarm.peer import Peer

NUMEL = 150_000
CHUNK_BYTES = 16384  # parts of 50,000 elements: 13 float32 chunks, 7 float16 ones
DELAY = 0.6          # after every chunk of the lagging stream (under SILENCE_FLOOR: it is not stalled)


def fetches(why: str) -> float:
    return REGISTRY.value("swarm_averaging_part_fetches_total", why=why) or 0.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("compression", [CompressionType.NONE, CompressionType.FLOAT16])
def test_a_lagging_part_is_completed_from_another_holder_and_every_member_holds_the_same_mean(compression):
    peers = [Peer() for _ in range(3)]
    try:
        addrs = [p.addrs[0] for p in peers]
        config = AveragerConfig(compression=compression, allreduce=AllReduceConfig(chunk_bytes=CHUNK_BYTES))
        # peer 0's stream of its mean to peer 1 waits DELAY after each chunk, in the second round only
        plans = [FaultPlan() for _ in peers]
        plans[0].add(FaultPoint.DURING_ALL_GATHER, Action.DELAY, rounds={1}, times=100, seconds=DELAY,
                     subject=peers[1].peer_id)
        values = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        avgs = [Averager(p, [v.clone()], prefix=f"tail-{compression.name}", target_group_size=3,
                         initial_group=addrs, config=config, faults=plan)
                for p, v, plan in zip(peers, values, plans)]
        lagging, stalled = fetches("lagging"), fetches("stalled")
        out = run_steps(avgs, timeout=30.0)
        assert all(not isinstance(x, Exception) and len(x.contributors) == 3 for x in out), out
        assert fetches("lagging") == lagging  # an ordinary round on loopback asks no one for a tail

        start = time.monotonic()
        out = run_steps(avgs, timeout=30.0)
        elapsed = time.monotonic() - start
        assert all(not isinstance(x, Exception) and len(x.contributors) == 3 for x in out), out
        assert plans[0].faults[0].fired >= 1
        assert fetches("lagging") == lagging + 1
        assert fetches("stalled") == stalled  # the stream flowed: nothing was given up on
        # the delayed stream alone needs at least DELAY per chunk but its last: peer 1 held the
        # part before that, so its tail came from the other holder
        chunks = -(-(NUMEL // 3) * 4 // CHUNK_BYTES) if compression is CompressionType.NONE else \
            -(-(NUMEL // 3) * 2 // CHUNK_BYTES)
        assert elapsed < (chunks - 1) * DELAY
        for a in avgs[1:]:
            assert torch.equal(a.tensors[0], avgs[0].tensors[0])  # bit-identical on every member
        mean = torch.stack(values).mean(0)
        tolerance = 1e-6 if compression is CompressionType.NONE else 2e-3
        assert torch.allclose(avgs[0].tensors[0], mean, atol=tolerance)
    finally:
        for p in peers:
            p.shutdown()


def test_a_tail_is_cut_into_the_parts_chunks_last_first():
    """Pure logic: what a holder sends for a tail fetch, and in which order."""
    assert tail_bounds(10, 3, 4) == [(7, 10), (3, 7)]
    assert tail_bounds(10, 0, 4) == [(8, 10), (4, 8), (0, 4)]
    assert tail_bounds(10, 10, 4) == []


def _member_holding(part_values: torch.Tensor, codec: CompressionType):
    """A round member as `serve_part` sees it: one remote part, held, under decision b"d"."""
    import asyncio
    from types import SimpleNamespace

    from swarm.averaging.parts import Part, PartState
    from swarm.compression import get_codec

    p = Part(0, 0, part_values.numel(), reducer=1, state=PartState.COMPLETE, decision=b"d", values=part_values)
    p.settled.set()
    return SimpleNamespace(parts=[p, Part(1, p.size, 0, reducer=0)], my_part=1, me=SimpleNamespace(is_sender=True),
                           codec=get_codec(codec), config=AllReduceConfig(chunk_bytes=CHUNK_BYTES),
                           deadline=asyncio.get_running_loop().time() + 5, reducer=None)


def test_a_holder_serves_a_tail_backwards_in_the_codec_asked_and_refuses_what_it_cannot_serve_exactly():
    import asyncio

    from swarm.averaging.allreduce import serve_part
    from swarm.compression import get_codec
    from swarm.core.errors import InvalidRequest
    from swarm.proto import averaging_pb2

    values = torch.randn(10_000, generator=torch.Generator().manual_seed(0)).half().float()  # exact in float16

    async def serve(codec: CompressionType, **request) -> list[bytes]:
        return [m async for m in serve_part(_member_holding(values, codec), 0, **request)]

    async def main() -> None:
        out = await serve(CompressionType.FLOAT16, start=3000, backward=True, compression=int(CompressionType.FLOAT16))
        header = averaging_pb2.ResultHeader.FromString(out[0])
        assert (header.start, header.backward, header.compression, header.decision) == (3000, True, 1, b"d")
        fp16 = get_codec(CompressionType.FLOAT16)
        got = torch.empty(10_000)
        bounds = tail_bounds(10_000, 3000, fp16.chunk_numel(CHUNK_BYTES))
        assert len(out) == 1 + len(bounds) and bounds[0][1] == 10_000 and bounds[-1][0] == 3000
        for message, (a, b) in zip(out[1:], bounds):
            fp16.decode(message, got[a:b])
        assert torch.equal(got[3000:], values[3000:])  # the held values, exactly
        whole = await serve(CompressionType.NONE)  # a lost part's fetch: all of it, float32, forward
        assert averaging_pb2.ResultHeader.FromString(whole[0]).start == 0 and len(whole) > 1
        for bad in ({"start": 10_001}, {"start": -1}, {"compression": int(CompressionType.UNIFORM_8BIT)},
                    {"compression": int(CompressionType.FLOAT16)}):  # FLOAT16 of a float32 round is lossy
            with pytest.raises(InvalidRequest):
                await serve(CompressionType.NONE, **bad)

    asyncio.run(main())
