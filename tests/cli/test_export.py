"""`swarm-peer export` as a real process: a checkpoint's parameters into a safetensors file that
reloads into the model bit for bit (the newest intact checkpoint when the newest is damaged), the
same from a live run through state transfer, and clear errors for what it cannot export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from swarm.checkpoint import CheckpointStore
from swarm.checkpoint.format import TENSORS_FILE
from swarm.cli.export import main as export_main
from swarm.core.errors import ConfigError
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


def tiny_gpt2(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    """A tiny GPT-2 as the transformers integration trains it, its config.json saved as a Trainer's
    output directory holds it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(3)
    net = transformers.GPT2LMHeadModel(config)
    config_dir = tmp_path / "run-output"
    config.save_pretrained(config_dir)
    return net, config_dir


def test_export_of_a_transformers_run_is_a_directory_from_pretrained_loads_bit_for_bit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    net, config_dir = tiny_gpt2(tmp_path)
    with torch.no_grad():  # "trained": every parameter moved off its initial value
        for p in net.parameters():
            p.add_(torch.randn_like(p))
    # the swarm's state: the trainable parameters in the integration's order, named param.<i>
    trained = [p for p in net.parameters() if p.requires_grad]
    store = CheckpointStore(tmp_path / "ckpt")
    store.save("hf-run", 7, 0, [(f"param.{i}", to_raw(p)) for i, p in enumerate(trained)],
               {"optimizer": {}, "scheduler": None}, [])
    out = tmp_path / "exported"
    # in this process: transformers is imported once (the command line is exercised above)
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--transformers", str(config_dir),
                        "--out", str(out)]) == 0
    assert "at epoch 7" in capsys.readouterr().out
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    expected = dict(net.named_parameters())
    got = dict(loaded.named_parameters())
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied

    other = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    other.save_pretrained(tmp_path / "other")
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--transformers", str(tmp_path / "other"),
                        "--out", str(tmp_path / "refused")]) == 1
    assert "another model" in capsys.readouterr().err
    assert not (tmp_path / "refused" / "model.safetensors").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_export_of_a_half_precision_transformers_run_keeps_its_dtype(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: torch.dtype) -> None:
    """A run trained in bf16/fp16 (its config's torch_dtype says so) is the same model, not another
    one: the file holds the parameters in the dtype the run trained them in."""
    transformers = pytest.importorskip("transformers")
    net, config_dir = tiny_gpt2(tmp_path)
    net = net.to(dtype)
    net.save_pretrained(config_dir)  # as a Trainer writes its output_dir: the config names the model's dtype
    saved = json.loads((config_dir / "config.json").read_text())
    assert saved.get("dtype", saved.get("torch_dtype")) == str(dtype).removeprefix("torch.")
    trained = [p for p in net.parameters() if p.requires_grad]
    store = CheckpointStore(tmp_path / "ckpt")
    store.save("hf-run", 3, 0, [(f"param.{i}", to_raw(p)) for i, p in enumerate(trained)],
               {"optimizer": {}, "scheduler": None}, [])
    out = tmp_path / "exported"
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--transformers", str(config_dir),
                        "--out", str(out)]) == 0, capsys.readouterr().err
    written = safetensors.torch.load_file(str(out / "model.safetensors"))
    expected = dict(net.named_parameters())
    assert {t.dtype for t in written.values()} == {dtype}
    assert all(torch.equal(written[name], expected[name].detach()) for name in written)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=dtype)
    assert all(torch.equal(p, expected[name]) for name, p in loaded.named_parameters())

    from swarm.optim.pretrained import match_names  # a parameter that is not floating point: refused

    ints = [(f"param.{i}", to_raw(p.detach().to(torch.int32))) for i, p in enumerate(trained)]
    with pytest.raises(ConfigError, match="not floating point"):
        match_names(ints, [(name, tuple(p.shape)) for name, p in net.named_parameters()])
