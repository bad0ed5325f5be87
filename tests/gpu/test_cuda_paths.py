"""Tensors on a CUDA device through averaging, state transfer and the expert client: one staging
copy through pinned host memory, and the peer's loop never waits for the device.

The tests marked `gpu` need CUDA and skip without it (`scripts/bench/gpu_check.sh` runs them on a
machine with GPUs); the others check the CPU side of the same paths. How the loop is watched: a
probe on the peer's loop wakes every 10 ms and records how late it woke; a kernel queued ahead of
the copies keeps the device busy for about a second, so a copy made on the loop would delay the
probe by that much.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from swarm.averaging import Averager
from swarm.averaging.partition import FlatTensors
from swarm.core.loop_lag import LoopLag
from swarm.moe import ExpertServer, RemoteExpert
from swarm.moe.client.expert import as_payload, payloads
from swarm.moe.server.experts import FeedforwardExpert

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LISTEN = "/ip4/127.0.0.1/tcp/0"


def test_cpu_tensors_are_used_in_place_and_sent_as_they_are() -> None:
    t = torch.arange(6, dtype=torch.float32)
    flat = FlatTensors([t])
    assert not flat.on_device
    assert flat.read(0, 6).data_ptr() == t.data_ptr()  # no staging copy for float32 on the CPU
    payload = as_payload(t)
    assert payload.data_ptr() == t.data_ptr()
    assert asyncio.run(payloads([t]))[0].data_ptr() == t.data_ptr()


def test_the_loop_probe_sees_a_stall_of_the_loop() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        lag = LoopLag(loop)

        stalled = threading.Event()

        def stall() -> None:
            time.sleep(0.3)  # blocking work on the loop: what the probe must see
            stalled.set()

        # 5 ms on: after the probe's first step (queued before it) set its 10 ms timer
        loop.call_soon_threadsafe(loop.call_later, 0.005, stall)
        assert stalled.wait(10)
        assert lag.stop() >= 0.25
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _busy_device(seconds: float = 1.0) -> None:
    """Queues a kernel that keeps the current CUDA device busy for about `seconds`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)  # cycles: measures the device's clock
    end.record()
    end.synchronize()
    seconds_per_cycle = start.elapsed_time(end) / 1e3 / 1e7
    torch.cuda._sleep(int(seconds / seconds_per_cycle))


@pytest.mark.gpu
@cuda
def test_cuda_tensors_are_staged_once_in_pinned_memory() -> None:
    t = torch.arange(6, dtype=torch.float32, device="cuda")
    flat = FlatTensors([t])
    assert flat.on_device
    flat.refresh()
    assert flat.read(0, 6).is_pinned() and flat.read(0, 6).tolist() == list(range(6))
    flat.write(0, torch.full((6,), 2.0))
    flat.commit()
    assert t.tolist() == [2.0] * 6
    payload = as_payload(t)
    assert payload.device.type == "cpu" and payload.is_pinned() and payload.tolist() == [2.0] * 6


@pytest.mark.gpu
@cuda
@pytest.mark.timeout(120)
def test_averaging_cuda_tensors_gives_the_mean_and_never_blocks_the_loop(make_peer) -> None:
    first = make_peer(listen=LISTEN)
    second = make_peer(listen=LISTEN, initial_peers=first.addrs)
    values = [torch.full((1 << 20,), float(i), device="cuda") for i in (1, 3)]
    averagers = [Averager(p, [v], prefix="gpu", target_group_size=2) for p, v in zip((first, second), values)]
    lags = [LoopLag(p.loop.loop) for p in (first, second)]

    def step(averager: Averager) -> None:
        _busy_device()
        averager.step(timeout=60)

    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(step, a) for a in averagers]
        for future in done:
            future.result(90)
    worst = [lag.stop() for lag in lags]
    for v in values:
        assert torch.all(v == 2.0)
    assert max(worst) < 0.25, f"the loop waited {max(worst):.2f} s for the device"


@pytest.mark.gpu
@cuda
@pytest.mark.timeout(120)
def test_a_remote_expert_on_gpu_inputs_matches_local_and_never_blocks_the_loop(make_peer) -> None:
    torch.manual_seed(0)
    module = FeedforwardExpert(64)
    local = FeedforwardExpert(64).cuda()
    local.load_state_dict(module.state_dict())
    server_peer = make_peer(listen=LISTEN)
    client = make_peer(listen=LISTEN, client_mode=True)
    ExpertServer(server_peer, {"ffn.0.0": module}, optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.0),
                 declare=False)
    expert = RemoteExpert(client, "ffn.0.0", server_peer.addrs[0])
    x = torch.randn(256, 64, device="cuda", requires_grad=True)
    lag = LoopLag(client.loop.loop)
    _busy_device()
    y = expert(x)
    y.sum().backward()
    worst = lag.stop()
    assert y.device == x.device and x.grad is not None and x.grad.device == x.device
    x_local = x.detach().clone().requires_grad_()
    y_local = local(x_local)
    y_local.sum().backward()
    torch.testing.assert_close(y, y_local, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, x_local.grad, rtol=1e-4, atol=1e-5)
    assert worst < 0.25, f"the client's loop waited {worst:.2f} s for the device"
