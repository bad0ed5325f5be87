"""Slow loris on an expert server: a caller sends a header declaring a large batch, then trickles its
tensors at 5 KiB/s, which keeps it under `body_timeout` (60 s) for most of a minute while it holds
a slot and the declared bytes. The server asks a minimum byte rate after a grace
(`ExpertServerConfig.min_body_rate`, `body_grace`), so the trickler loses its slot once its
bytes stop paying for its time, and an honest call of the same size is served."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from swarm.core.errors import DeadlineExceeded, RemoteError, RPCError
from swarm.moe import ExpertServer, ExpertServerConfig, RemoteExpert
from swarm.moe.protocol import FORWARD
from swarm.moe.schema import TensorSchema
from swarm.net.streaming import tensors_to_messages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]
HID = 8
ROWS = 4096  # 128 KiB of float32: 25 s at the trickle's pace


async def _trickle(messages: list[bytes]):
    yield messages[0]
    for chunk in messages[1:]:
        await asyncio.sleep(0.05)  # the attacker's pace: 256 bytes per 50 ms
        yield chunk


def test_a_body_trickled_below_the_minimum_rate_loses_its_slot(make_peer) -> None:
    config = ExpertServerConfig()
    assert config.body_timeout >= 60 and config.min_body_rate > 5 << 10
    server = ExpertServer(make_peer(), {"ffn.0": nn.Linear(HID, HID)}, declare=False, config=config,
                          args_schema=[TensorSchema((HID,), torch.float32)])
    attacker = make_peer(client_mode=True)
    honest = make_peer(client_mode=True)
    addr = server.peer.addrs[0]
    messages = list(tensors_to_messages([torch.randn(ROWS, HID)], {"uid": "ffn.0", "graph": None}, chunk_bytes=256))

    async def attack() -> BaseException | None:
        try:
            async for _ in attacker.pool.get(addr).stream(FORWARD, _trickle(messages), timeout=120):
                pass
        except RPCError as e:
            return e
        return None

    # within half of body_timeout: the rate, not the timeout, ends the call
    outcome = attacker.run(attack(), timeout=config.body_timeout / 2)
    assert server.stats()["too_slow"] == 1, server.stats()
    # The server ends the call while the trickler is still writing. Its status says why, unless the
    # trickler's next write fails first: then grpc.aio reports its own INTERNAL ("Internal error from
    # Core") in place of the status it had not read yet; a caller that keeps writing can meet either.
    assert isinstance(outcome, RPCError), outcome
    if not (isinstance(outcome, DeadlineExceeded) and "too slowly" in str(outcome)):
        assert isinstance(outcome, RemoteError) and "Internal error from Core" in str(outcome), outcome
    server.wait_idle(timeout=10)  # its slot and bytes are free
    assert server.stats()["inflight_bytes"] == 0
    output = RemoteExpert(honest, "ffn.0", addr, forward_timeout=20)(torch.randn(ROWS, HID))
    assert output.shape == (ROWS, HID)
