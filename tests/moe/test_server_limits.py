"""An ExpertServer refuses bad requests with clear statuses and survives a burst of 1,000 calls.

Every case below reaches the client as the swarm.core.errors class named, and the server
answers a good request right after.
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
from torch import nn

from swarm.core.errors import InvalidRequest, NotFound, ResourceExhausted
from swarm.moe import ExpertServer, ExpertServerConfig, RemoteExpert
from swarm.moe.protocol import FORWARD, call_backward, call_forward
from swarm.moe.schema import TensorSchema
from swarm.net.streaming import tensors_to_messages

pytestmark = pytest.mark.timeout(90)
HID = 8


class Gate(nn.Module):
    """Doubles its input; while `closed`, the compute thread waits inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.opened.set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        if not self.opened.wait(30):
            raise TimeoutError("gate never opened")
        return x * 2


@pytest.fixture
def served(make_peer):
    server_peer, client = make_peer(), make_peer(client_mode=True)
    gate = Gate()
    config = ExpertServerConfig(max_batch_size=16, max_inflight_requests=32, max_inflight_bytes=1 << 20)
    server = ExpertServer(
        server_peer, {"ffn.0": nn.Linear(HID, HID), "gate.0": gate}, declare=False, config=config,
        args_schema=[TensorSchema((HID,), torch.float32)],
    )
    yield server, client, gate
    gate.opened.set()


def call(client, server, uid: str, *tensors: torch.Tensor, backward: bool = False):
    async def go():
        channel = client.pool.get(server.peer.addrs[0])
        if backward:
            return await call_backward(channel, uid, tensors[:1], tensors[1:], timeout=10)
        return await call_forward(channel, uid, tensors, timeout=10)

    return client.run(go(), timeout=20)


@pytest.mark.parametrize(
    ("uid", "tensors", "error", "fragment"),
    [
        ("ffn.9", [torch.randn(2, HID)], NotFound, "expert 'ffn.9' is not hosted"),
        ("ffn.0", [torch.randn(2, HID + 1)], InvalidRequest, f"has shape (2, {HID + 1}), expected (batch, {HID})"),
        ("ffn.0", [torch.randn(2, 2, HID)], InvalidRequest, "expected (batch, 8)"),
        ("ffn.0", [torch.randn(2, HID).double()], InvalidRequest, "dtype float64, expected float32"),
        ("ffn.0", [torch.full((2, HID), math.nan)], InvalidRequest, "NaN or infinite"),
        ("ffn.0", [torch.full((2, HID), -math.inf)], InvalidRequest, "NaN or infinite"),
        ("ffn.0", [torch.randn(17, HID)], ResourceExhausted, "batch of 17 rows exceeds the limit of 16"),
        ("ffn.0", [torch.randn(0, HID)], InvalidRequest, "the batch is empty"),
        ("ffn.0", [torch.randn(2, HID), torch.randn(2, HID)], InvalidRequest, "expected 1 tensors, got 2"),
        ("ffn.0", [], InvalidRequest, "expected 1 tensors, got 0"),
    ],
)
def test_bad_forward_gets_a_clear_status_and_the_server_goes_on(served, uid, tensors, error, fragment) -> None:
    server, client, _ = served
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call(client, server, uid, *tensors)
    (y,) = call(client, server, "ffn.0", torch.ones(3, HID))
    assert y.shape == (3, HID)


def test_bad_backward_gets_a_clear_status(served) -> None:
    server, client, _ = served
    x = torch.randn(2, HID)
    with pytest.raises(InvalidRequest, match="tensors disagree on the batch size"):
        call(client, server, "ffn.0", x, torch.randn(3, HID), backward=True)
    with pytest.raises(InvalidRequest, match="NaN or infinite"):
        call(client, server, "ffn.0", x, torch.full((2, HID), math.nan), backward=True)
    with pytest.raises(InvalidRequest, match="expected 2 tensors, got 1"):
        call(client, server, "ffn.0", x, backward=True)
    (g,) = call(client, server, "ffn.0", x, torch.ones(2, HID), backward=True)
    assert g.shape == (2, HID)


def raw_stream(client, server, messages: list[bytes]):
    async def go():
        channel = client.pool.get(server.peer.addrs[0])
        return [m async for m in channel.stream(FORWARD, messages, timeout=10)]

    return client.run(go(), timeout=20)


def test_malformed_streams_are_refused(served) -> None:
    server, client, _ = served
    with pytest.raises(InvalidRequest, match="malformed expert request header"):
        raw_stream(client, server, [b"\xff\x00garbage"])
    with pytest.raises(InvalidRequest, match="empty request stream"):
        raw_stream(client, server, [])
    header, chunk = list(tensors_to_messages([torch.randn(4, HID)], {"uid": "ffn.0", "graph": None}))
    with pytest.raises(InvalidRequest, match="must carry metadata"):
        raw_stream(client, server, list(tensors_to_messages([torch.randn(4, HID)], {"graph": 1})))
    with pytest.raises(InvalidRequest, match="graph id must be an int"):
        raw_stream(client, server, list(tensors_to_messages([torch.randn(4, HID)], {"uid": "ffn.0", "graph": "x"})))
    with pytest.raises(InvalidRequest, match="ended after 0 of 128 bytes"):
        raw_stream(client, server, [header])
    with pytest.raises(InvalidRequest, match="more bytes than its header declared"):
        raw_stream(client, server, [header, chunk + b"extra"])
    (y,) = call(client, server, "ffn.0", torch.ones(3, HID))
    assert y.shape == (3, HID)


def test_a_request_over_the_byte_budget_is_refused_before_it_is_read(make_peer) -> None:
    server_peer, client = make_peer(), make_peer(client_mode=True)
    config = ExpertServerConfig(max_batch_size=4096, max_inflight_bytes=64 << 10)
    server = ExpertServer(server_peer, {"ffn.0": nn.Linear(HID, HID)}, declare=False, config=config)
    with pytest.raises(ResourceExhausted, match="exceed the server's budget"):
        call(client, server, "ffn.0", torch.randn(4096, HID))
    (y,) = call(client, server, "ffn.0", torch.ones(3, HID))
    assert y.shape == (3, HID)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_burst_of_1000_requests_is_queued_or_refused_and_leaks_nothing(served) -> None:
    server, client, gate = served
    expert = RemoteExpert(client, "gate.0", server.peer.addrs[0], forward_timeout=30)
    inputs = [torch.full((1, HID), float(i)) for i in range(1000)]
    admitted = server.config.max_inflight_requests
    all_refusals = threading.Event()
    refused = 0

    async def one(x: torch.Tensor) -> object:
        nonlocal refused
        try:
            return await expert.acall_forward(x)
        except ResourceExhausted as e:
            refused += 1
            if refused == len(inputs) - admitted:
                all_refusals.set()
            return e

    async def burst() -> list[object]:
        nonlocal refused
        refused = 0
        return await asyncio.gather(*(one(x) for x in inputs), return_exceptions=True)

    def check(results: list[object]) -> int:
        ok = 0
        for x, result in zip(inputs, results):
            if isinstance(result, ResourceExhausted):
                continue
            assert isinstance(result, list), f"unexpected outcome {result!r}"
            assert torch.equal(result[0], x * 2)
            ok += 1
        return ok

    # 1) the compute thread is stuck: exactly max_inflight_requests calls are admitted, the rest refused
    #    (the client keeps MAX_STREAMS_PER_PEER = 128 > 32 calls in flight, queueing the others)
    gate.opened.clear()
    future = client.loop.submit(burst())
    assert gate.entered.wait(20), "the first batch never started"
    assert all_refusals.wait(30), f"only {refused} refusals; server: {server.stats()}"
    gate.opened.set()
    assert check(future.result(60)) == admitted
    # 2) open bursts: whatever is not refused is answered correctly, and memory does not grow
    rss = []
    for _ in range(3):
        assert check(client.run(burst(), timeout=60)) > 0
        server.wait_idle(timeout=10)
        rss.append(rss_bytes())
    stats = server.stats()
    assert stats["inflight_requests"] == 0 and stats["inflight_bytes"] == 0
    assert all(p.queued_tasks == 0 for p in stats["pools"].values())
    assert rss[-1] - rss[0] < 64 << 20, f"RSS grew by {(rss[-1] - rss[0]) >> 20} MiB over two bursts"
    (y,) = call(client, server, "ffn.0", torch.ones(3, HID))
    assert y.shape == (3, HID)
