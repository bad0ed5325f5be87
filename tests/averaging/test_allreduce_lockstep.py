"""A peer's streams of one phase kept level (`swarm.averaging.lockstep`): pure logic on one loop."""

from __future__ import annotations

import asyncio

import pytest

from swarm.averaging import AllReduceConfig
from swarm.averaging.lockstep import Lockstep
from swarm.core.errors import ConfigError


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def _send(lockstep: Lockstep, key: str, chunks: int, log: list[tuple[str, int]]) -> None:
    try:
        for i in range(chunks):
            await lockstep.turn(key)
            log.append((key, i))
            await asyncio.sleep(0)  # the connection takes the chunk
            lockstep.sent(key)
    finally:
        lockstep.leave(key)


def _spread(log: list[tuple[str, int]], keys: list[str], chunks: int) -> int:
    """The most chunks one stream had started beyond another still running, over the log."""
    started = dict.fromkeys(keys, 0)
    worst = 0
    for key, i in log:
        started[key] = i + 1
        running = [n for n in started.values() if n < chunks]
        if running:
            worst = max(worst, started[key] - min(running))
    return worst


def test_a_stream_waits_while_it_is_ahead_of_the_slowest_and_goes_on_once_it_caught_up():
    async def main():
        lockstep = Lockstep(["fast", "slow"], ahead=2)
        for _ in range(2):
            assert lockstep.may_send("fast")
            lockstep.sent("fast")
        assert not lockstep.may_send("fast")  # two ahead of "slow"
        waiting = asyncio.ensure_future(lockstep.turn("fast"))
        await asyncio.sleep(0)
        assert not waiting.done()
        lockstep.sent("slow")
        await asyncio.wait_for(waiting, 1)
        assert lockstep.waits == 1
        lockstep.sent("fast")
        assert not lockstep.may_send("fast")
        lockstep.leave("slow")  # finished (or failed): nobody waits for it any more
        assert lockstep.may_send("fast")
        assert lockstep.running == {"fast"}

    run(main())


def test_streams_sent_at_once_stay_within_ahead_chunks_of_each_other_and_all_finish():
    async def main():
        keys = ["a", "b", "c"]
        log: list[tuple[str, int]] = []
        lockstep = Lockstep(keys, ahead=1)
        # "a" gets three turns of the loop per chunk, "c" one: left alone "c" would finish first
        async def slow(key: str, chunks: int, extra: int) -> None:
            try:
                for i in range(chunks):
                    await lockstep.turn(key)
                    log.append((key, i))
                    for _ in range(extra):
                        await asyncio.sleep(0)
                    lockstep.sent(key)
            finally:
                lockstep.leave(key)
        await asyncio.gather(slow("a", 8, 3), slow("b", 8, 2), slow("c", 8, 1))
        assert sorted(log) == sorted((k, i) for k in keys for i in range(8))
        assert _spread(log, keys, 8) <= 1
        assert lockstep.waits > 0

    run(main())


def test_a_waiting_stream_is_woken_even_when_the_one_it_waited_for_sends_and_waits_in_the_same_step():
    """The wake-up of a waiting stream is its own: the faster stream catching up and then waiting
    itself before the first one ran again must not swallow it (a shared event, cleared by the
    second waiter, did: every phase then stalled for a whole patience)."""
    async def main():
        lockstep = Lockstep(["a", "b"], ahead=2, default_patience=30.0)
        lockstep.sent("a")
        lockstep.sent("a")

        async def b_side() -> None:
            for _ in range(4):
                lockstep.sent("b")
            await lockstep.turn("b")  # 4 against "a"'s 2: waits

        a = asyncio.ensure_future(lockstep.turn("a"))  # 2 against 0: waits
        b = asyncio.ensure_future(b_side())
        await asyncio.wait_for(a, 5)  # woken by "b"'s chunks, long before the 30 s patience
        assert not b.done()
        lockstep.sent("a")
        lockstep.sent("a")
        await asyncio.wait_for(b, 5)

    run(main())


def test_ahead_zero_never_waits():
    async def main():
        lockstep = Lockstep(["a", "b"], ahead=0)
        log: list[tuple[str, int]] = []
        await _send(lockstep, "a", 5, log)  # "b" never sends
        assert [i for _, i in log] == [0, 1, 2, 3, 4]
        assert lockstep.waits == 0

    run(main())


def test_a_stream_silent_past_its_patience_stops_holding_the_others_back():
    async def main():
        lockstep = Lockstep(["live", "stalled"], ahead=1, patience={"stalled": 0.05, "live": 30.0})
        log: list[tuple[str, int]] = []
        await _send(lockstep, "live", 4, log)  # "stalled" never sends: dropped after its patience
        assert [i for _, i in log] == [0, 1, 2, 3]
        assert "stalled" not in lockstep.running
        assert lockstep.may_send("stalled")  # should it come back, it is not held either

    run(main())


def test_the_setting_is_checked():
    with pytest.raises(ConfigError):
        AllReduceConfig(lockstep=-1)
    assert AllReduceConfig().lockstep > 0
    with pytest.raises(ValueError):
        run(_make(-1))


async def _make(ahead: int) -> Lockstep:
    return Lockstep(["a"], ahead=ahead)
