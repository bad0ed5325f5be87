"""Attacks 4 and 8 on an expert server process: one identity opens 256 Forward streams that send
nothing and 100 that send a header and stall, then names an expert with a 1 MB uid. No silent
stream holds a slot, one caller holds at most its share, stalled calls are refused, and an
honest client is served throughout; the refusal of the long uid is NOT_FOUND, not echoed back."""

from __future__ import annotations

import asyncio

import pytest
import torch
from attacks import HID, serve

from swarm.core.errors import DeadlineExceeded, NotFound, ResourceExhausted, RPCError
from swarm.moe import RemoteExpert
from swarm.moe.protocol import FORWARD, call_forward
from swarm.net.streaming import tensors_to_messages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def _held(stall: asyncio.Event, first: list[bytes]):
    for message in first:
        yield message
    await stall.wait()


def test_silent_and_stalled_streams_cannot_lock_out_an_expert_server(make_peer) -> None:
    with serve("ffn.[0:2]") as server:
        attacker = make_peer(client_mode=True)
        honest = make_peer(client_mode=True)
        addr = server.addrs[0]
        header = next(tensors_to_messages([torch.randn(2, HID)], {"uid": "ffn.0", "graph": None}))

        async def attack() -> tuple[list[asyncio.Task], asyncio.Event, asyncio.Event]:
            silence, stall = asyncio.Event(), asyncio.Event()
            channel = attacker.pool.get(addr)

            async def one(first: list[bytes], until: asyncio.Event) -> BaseException | None:
                try:
                    async for _ in channel.stream(FORWARD, _held(until, first), timeout=600):
                        pass
                except RPCError as e:
                    return e
                return None

            tasks = [asyncio.ensure_future(one([], silence)) for _ in range(256)]
            tasks += [asyncio.ensure_future(one([header], stall)) for _ in range(100)]
            # a probe on the same connection, opened after them: once it is answered, the server
            # has taken up every stream before it
            try:
                await call_forward(channel, "ffn.9", [torch.randn(2, HID)], timeout=30)
            except (NotFound, ResourceExhausted):
                pass
            return tasks, silence, stall

        tasks, silence, stall = attacker.run(attack(), timeout=60)
        try:
            output = RemoteExpert(honest, "ffn.1", addr, forward_timeout=20)(torch.randn(3, HID))
            assert output.shape == (3, HID)

            async def outcomes(some: list[asyncio.Task]) -> list[BaseException | None]:
                return list(await asyncio.gather(*some))

            silent = attacker.run(outcomes(tasks[:256]), timeout=60)  # header_timeout (10 s) ends them
            assert all(isinstance(r, DeadlineExceeded) for r in silent), {type(r) for r in silent}
            attacker.loop.loop.call_soon_threadsafe(stall.set)  # the stalled ones give up
            stalled = attacker.run(outcomes(tasks[256:]), timeout=60)
            per_caller = [r for r in stalled if isinstance(r, ResourceExhausted)]
            assert len(per_caller) >= 100 - 64 and all("per caller" in str(r) for r in per_caller)
        finally:
            attacker.loop.loop.call_soon_threadsafe(silence.set)
            attacker.loop.loop.call_soon_threadsafe(stall.set)
        assert server.proc.poll() is None


def test_a_forward_naming_a_1_mb_uid_is_not_found_and_not_echoed_back(make_peer) -> None:
    with serve("ffn.[0:2]") as server:
        client = make_peer(client_mode=True)
        channel = client.pool.get(server.addrs[0])
        long_uid = "ffn." + "1" * 1_000_000
        with pytest.raises(NotFound) as refused:
            client.run(call_forward(channel, long_uid, [torch.randn(2, HID)], timeout=30))
        assert len(str(refused.value)) < 1000
        (output,) = client.run(call_forward(channel, "ffn.0", [torch.randn(2, HID)], timeout=30))
        assert output.shape == (2, HID)
