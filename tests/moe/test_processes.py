"""Expert servers as real `python -m swarm --experts ...` processes: SIGKILL, restart, bad options."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from procs import PeerProcess

from swarm.core.errors import MoEError
from swarm.moe import RemoteExpert, RemoteMixtureOfExperts
from swarm.moe.server.checkpoints import checkpoint_path
from swarm.moe.server.experts import FeedforwardExpert

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
HID = 16


def serve(pattern: str, *extra: str, wait: bool = True) -> PeerProcess:
    """Starts an expert server; with `wait=False`, read its address later with `ready()`."""
    return PeerProcess(
        "--listen", "/ip4/127.0.0.1/tcp/0", "--experts", pattern, "--expert-cls", "ffn",
        "--hidden-dim", str(HID), "--log-level", "WARNING", *extra, ready_timeout=60, expect_addrs=int(wait),
    )


def ready(*servers: PeerProcess) -> None:
    for server in servers:
        server.addrs = server.read_lines(1, timeout=60)


def test_mixture_keeps_training_when_a_server_is_sigkilled(make_peer) -> None:
    client = make_peer()  # a full peer: the servers join the DHT through it
    with serve("ffn.[0:2].0", "--initial-peers", client.addrs[0], wait=False) as left, \
         serve("ffn.[0:2].1", "--initial-peers", client.addrs[0], wait=False) as right:
        ready(left, right)  # both start at once
        torch.manual_seed(0)
        # k_best=3 of a 2x2 grid: every sample uses experts of both servers
        moe = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(2, 2), uid_prefix="ffn.", k_best=3,
                                     forward_timeout=10, backward_timeout=10)
        head = torch.nn.Linear(HID, 1)
        opt = torch.optim.Adam([*moe.parameters(), *head.parameters()], lr=1e-2)
        x = torch.randn(128, HID)
        target = (x[:, :1] * 2 - x[:, 1:2]).tanh()
        losses = []
        for step in range(36):
            if step == 12:
                right.proc.send_signal(signal.SIGKILL)
                right.proc.wait(10)
            loss = (head(moe(x)) - target).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert min(losses[30:]) < 0.7 * losses[0], losses
        assert left.proc.poll() is None
        # only the left server's two experts are alive now: a mixture that needs three per sample fails clearly
        strict = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(2, 2), uid_prefix="ffn.", k_best=4,
                                        k_min=3, forward_timeout=10)
        with pytest.raises(MoEError, match="fewer than k_min=3"):
            strict(x)
        assert left.stop() == 0


def test_restarted_server_resumes_from_its_checkpoint(make_peer, tmp_path: Path) -> None:
    client = make_peer(client_mode=True)
    args = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--identity", str(tmp_path / "key"))
    probe = torch.randn(5, HID)
    with serve("ffn.[0:2]", *args) as first:
        expert = RemoteExpert(client, "ffn.1", first.addrs[0])
        for _ in range(4):
            x = torch.randn(8, HID, requires_grad=True)
            expert(x).square().sum().backward()
        with torch.no_grad():
            before = expert(probe)
        assert expert.info.updates == 4
        assert first.stop() == 0  # SIGINT: saves the checkpoints, exits 0
    state = torch.load(checkpoint_path(tmp_path / "ckpt", "ffn.1"), weights_only=True)["state"]
    module = FeedforwardExpert(HID)
    module.load_state_dict(state["module"])
    with torch.no_grad():
        torch.testing.assert_close(module(probe), before, rtol=1e-5, atol=1e-6)
    with serve("ffn.[0:2]", *args) as second:
        assert second.addrs[0].endswith(first.addrs[0].rsplit("/", 1)[1])  # same identity, new port
        restarted = RemoteExpert(client, "ffn.1", second.addrs[0])
        with torch.no_grad():
            after = restarted(probe)
        assert torch.equal(after, before)
        assert restarted.info.updates == 4
        assert second.stop() == 0


def test_bad_expert_options_exit_with_a_clear_error() -> None:
    proc = PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--experts", "ffn.[3:1]", expect_addrs=0)
    with proc:
        assert proc.wait(60) == 2
        assert "range '[3:1]' is empty" in proc.stderr_text()
