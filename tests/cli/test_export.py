"""`swarm-peer export` as a real process: a checkpoint's parameters into a safetensors file that
reloads into the model bit for bit (the newest intact checkpoint when the newest is damaged), the
same from a live run through state transfer, and clear errors for what it cannot export."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import safetensors.torch
import torch

from swarm.checkpoint import CheckpointStore
from swarm.checkpoint.format import TENSORS_FILE
from swarm.optim.checkpointing import to_raw


def export(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarm", "export", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def save(store: CheckpointStore, net: torch.nn.Module, epoch: int) -> None:
    params = [(name, to_raw(p)) for name, p in net.named_parameters()]
    store.save("run-x", epoch, 0, params, {"optimizer": {}, "scheduler": None}, [])


def test_export_from_a_checkpoint_reloads_into_the_model_bit_for_bit(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    save(store, model(1), 4)
    save(store, model(2), 5)
    os.truncate(store.path_of(5) / TENSORS_FILE, 100)  # the newest damaged: the one before is exported
    out = tmp_path / "out" / "model.safetensors"
    done = export("--checkpoint", str(store.root), "--run", "run-x", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "of run 'run-x' at epoch 4" in done.stdout
    reloaded = model(3)
    reloaded.load_state_dict(safetensors.torch.load_file(str(out)))  # strict: every name matches
    for mine, theirs in zip(reloaded.parameters(), model(1).parameters()):
        assert torch.equal(mine, theirs)
    assert [p.name for p in out.parent.iterdir()] == ["model.safetensors"]  # no temporary file left

    done = export("--checkpoint", str(store.path_of(4)), "--out", str(tmp_path / "one.safetensors"))
    assert done.returncode == 0 and "at epoch 4" in done.stdout, done.stderr


def test_export_says_why_it_cannot(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    save(store, model(1), 1)
    done = export("--checkpoint", str(store.root), "--run", "other", "--out", str(tmp_path / "m.safetensors"))
    assert done.returncode == 1 and "run 'run-x', not of run 'other'" in done.stderr
    done = export("--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "m.safetensors"))
    assert done.returncode == 1 and "no checkpoint" in done.stderr
    done = export("--out", str(tmp_path / "m.safetensors"))
    assert done.returncode == 2 and "give --checkpoint DIR" in done.stderr
    assert not (tmp_path / "m.safetensors").exists()


def test_export_from_a_live_run_downloads_the_state_its_peers_hold(tmp_path: Path) -> None:
    from swarm.optim import CollaborationConfig, Optimizer
    from swarm.peer import Peer

    net = model(1)
    with Peer(listen="/ip4/127.0.0.1/tcp/0") as peer:
        opt = Optimizer(peer, run_id="live", params=net.parameters(), optimizer=lambda ps: torch.optim.Adam(ps),
                        batch_size_per_step=4, config=CollaborationConfig(target_batch_size=8, report_period=0.1))
        x = torch.randn(4, 8)
        while opt.epoch < 2:
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out = tmp_path / "live.safetensors"
        done = export("--run", "live", "--initial-peers", peer.addrs[0], "--out", str(out), "--timeout", "60")
        opt.shutdown()
    assert done.returncode == 0, done.stderr
    assert "of run 'live' at epoch 2" in done.stdout
    tensors = safetensors.torch.load_file(str(out))
    for i, p in enumerate(net.parameters()):
        assert torch.equal(tensors[f"param.{i}"], p.detach())
