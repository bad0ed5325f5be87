"""ExpertServer lifecycle: construction checks, batching across callers, checkpoints, shutdown."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from swarm.core.errors import ConfigError, PeerUnreachable, RemoteError
from swarm.moe import ExpertServer, ExpertServerConfig, RemoteExpert
from swarm.moe.schema import TensorSchema
from swarm.moe.server.hosted import BatchingConfig

pytestmark = pytest.mark.timeout(60)
HID = 6


def test_construction_is_checked(make_peer) -> None:
    peer = make_peer()
    with pytest.raises(ConfigError, match="client-mode peer cannot serve"):
        ExpertServer(make_peer(client_mode=True), {"ffn.0": nn.Linear(HID, HID)})
    with pytest.raises(ValueError, match="invalid expert uid"):
        ExpertServer(peer, {"ffn": nn.Linear(HID, HID)})
    with pytest.raises(ValueError, match="cannot infer its input schema"):
        ExpertServer(peer, {"ffn.0": nn.ReLU()})
    ExpertServer(peer, {"ffn.0": nn.ReLU()}, args_schema=[TensorSchema((HID,), torch.float32)], declare=False)
    with pytest.raises(ConfigError, match="already hosts an ExpertServer"):
        ExpertServer(peer, {"ffn.1": nn.Linear(HID, HID)}, declare=False)


class Gated(nn.Module):
    """A linear expert whose batches wait for `opened` once `close()` was called; records batch sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HID, HID)
        self.opened = threading.Event()
        self.opened.set()  # the server runs the module once on a sample, at construction
        self.entered = threading.Event()
        self.batches: list[int] = []

    def close(self) -> None:
        self.opened.clear()
        self.entered.clear()
        self.batches.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append(x.shape[0])
        self.entered.set()
        if not self.opened.wait(30):
            raise TimeoutError("never opened")
        return self.lin(x)


@pytest.mark.parametrize(("max_batch_tasks", "batches"), [(None, [2, 12]), (1, [2] * 7)])
def test_concurrent_callers_are_batched_unless_batching_is_off(make_peer, max_batch_tasks, batches) -> None:
    peer = make_peer()
    module = Gated()
    config = ExpertServerConfig(batching=BatchingConfig(max_batch_tasks=max_batch_tasks))
    server = ExpertServer(peer, {"ffn.0": module}, declare=False, config=config)
    module.close()
    experts = [RemoteExpert(make_peer(client_mode=True), "ffn.0", peer.addrs[0]) for _ in range(3)]
    xs = [torch.randn(2, HID) for _ in range(7)]

    def submit(i: int):
        expert = experts[i % len(experts)]
        return expert.peer.loop.submit(expert.acall_forward(xs[i]))

    futures = [submit(0)]
    assert module.entered.wait(20)  # the first request holds the compute thread...
    futures += [submit(i) for i in range(1, 7)]
    assert server.experts["ffn.0"].forward_pool.wait_queued(6, timeout=20)  # ...while six more queue up
    module.opened.set()
    for x, future in zip(xs, futures):
        (y,) = future.result(20)
        torch.testing.assert_close(y, module.lin(x).detach())
    assert module.batches == batches


def test_checkpoints_are_saved_at_shutdown_and_restored(make_peer, tmp_path: Path) -> None:
    torch.manual_seed(0)
    peer, client = make_peer(), make_peer(client_mode=True)
    server = ExpertServer(peer, {"ffn.0": nn.Linear(HID, HID)}, checkpoint_dir=tmp_path, declare=False)
    assert server.restored == []
    expert = RemoteExpert(client, "ffn.0", peer.addrs[0])
    expert(torch.randn(3, HID)).sum().backward()
    trained = {k: v.clone() for k, v in server.backends["ffn.0"].module.state_dict().items()}
    peer.shutdown()
    assert (tmp_path / "ffn.0.pt").exists()
    again = ExpertServer(make_peer(), {"ffn.0": nn.Linear(HID, HID)}, checkpoint_dir=tmp_path, declare=False)
    assert again.restored == ["ffn.0"] and again.backends["ffn.0"].updates == 1
    for key, value in again.backends["ffn.0"].module.state_dict().items():
        assert torch.equal(value, trained[key])


def test_shutdown_fails_queued_calls_and_refuses_new_ones(make_peer) -> None:
    peer, client = make_peer(), make_peer(client_mode=True)
    module = Gated()
    server = ExpertServer(peer, {"ffn.0": module}, declare=False,
                          config=ExpertServerConfig(runtime_shutdown_timeout=0.5))
    module.close()
    expert = RemoteExpert(client, "ffn.0", peer.addrs[0])
    running = client.loop.submit(expert.acall_forward(torch.randn(1, HID)))
    assert module.entered.wait(20)
    queued = client.loop.submit(expert.acall_forward(torch.randn(1, HID)))
    assert server.experts["ffn.0"].forward_pool.wait_queued(1, timeout=20)
    stopping = threading.Thread(target=server.shutdown)
    stopping.start()
    with pytest.raises(RemoteError, match="shut down before the task ran"):
        queued.result(20)
    module.opened.set()
    stopping.join(20)
    try:  # the running batch either finishes within the shutdown's grace, or fails clearly
        (y,) = running.result(20)
        assert y.shape == (1, HID)
    except RemoteError as e:
        assert "shut down while the task was running" in str(e)
    with pytest.raises(PeerUnreachable, match="shutting down"):
        client.run(expert.acall_forward(torch.randn(1, HID)), timeout=20)
