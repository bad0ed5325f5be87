"""Tests of swarm.moe.server.checkpoints: atomic saves, exact restores, corrupt files."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from swarm.moe.server.backend import ExpertBackend
from swarm.moe.server.checkpoints import (
    CheckpointError,
    CheckpointSaver,
    checkpoint_path,
    load_experts,
    save_experts,
)
from swarm.moe.server.experts import make_backend

HID = 8
UIDS = ["ffn.0.0", "ffn.0.1"]


def build(seed: int, uids: list[str] = UIDS) -> dict[str, ExpertBackend]:
    torch.manual_seed(seed)
    return {
        uid: make_backend(
            "ffn",
            uid,
            HID,
            scheduler_factory=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9),
        )
        for uid in uids
    }


def train(backends: dict[str, ExpertBackend], steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for backend in backends.values():
        for _ in range(steps):
            x = torch.randn(4, HID, generator=gen)
            backend.backward(x, torch.randn(4, HID, generator=gen))


def assert_same_state(a: ExpertBackend, b: ExpertBackend) -> None:
    for (ka, pa), (kb, pb) in zip(a.module.state_dict().items(), b.module.state_dict().items()):
        assert ka == kb and torch.equal(pa, pb)
    assert a.optimizer is not None and b.optimizer is not None
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for key in sa["state"]:
        for name, value in sa["state"][key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][key][name]))
    assert a.scheduler is not None and b.scheduler is not None
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    assert a.updates == b.updates


def test_save_load_restores_exact_state_and_next_update(tmp_path: Path) -> None:
    original = build(seed=1)
    train(original, steps=3, seed=0)
    paths = save_experts(original, tmp_path)
    assert paths == [tmp_path / f"{uid}.pt" for uid in UIDS]
    assert sorted(os.listdir(tmp_path)) == ["ffn.0.0.pt", "ffn.0.1.pt"]  # no temp files left

    restored = build(seed=2)
    assert not torch.equal(restored["ffn.0.0"].module.ffn.weight, original["ffn.0.0"].module.ffn.weight)
    assert sorted(load_experts(restored, tmp_path)) == UIDS
    for uid in UIDS:
        assert_same_state(original[uid], restored[uid])

    # the next backward gives identical input gradients and identical parameter updates
    train(original, steps=1, seed=5)
    train(restored, steps=1, seed=5)
    for uid in UIDS:
        assert_same_state(original[uid], restored[uid])
    x, g = torch.randn(2, HID), torch.randn(2, HID)
    assert torch.equal(original["ffn.0.0"].backward(x, g)[0], restored["ffn.0.0"].backward(x, g)[0])


def test_load_skips_experts_without_files(tmp_path: Path) -> None:
    save_experts(build(seed=1, uids=["ffn.0.0"]), tmp_path)
    fresh = build(seed=2)
    before = fresh["ffn.0.1"].module.ffn.weight.detach().clone()
    assert load_experts(list(fresh.values()), tmp_path) == ["ffn.0.0"]
    assert torch.equal(fresh["ffn.0.1"].module.ffn.weight, before)
    assert load_experts(fresh, tmp_path / "missing") == []


def test_corrupt_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    save_experts(build(seed=1), tmp_path)
    bad = checkpoint_path(tmp_path, "ffn.0.1")
    bad.write_bytes(bad.read_bytes()[:100])
    fresh = build(seed=2)
    with pytest.raises(CheckpointError, match=f"checkpoint {bad} of expert ffn.0.1 is unreadable or corrupt"):
        load_experts(fresh, tmp_path)


def test_foreign_or_mismatched_checkpoint_is_refused(tmp_path: Path) -> None:
    save_experts(build(seed=1), tmp_path)
    os.replace(checkpoint_path(tmp_path, "ffn.0.0"), checkpoint_path(tmp_path, "ffn.0.1"))
    with pytest.raises(CheckpointError, match="holds expert 'ffn.0.0', not 'ffn.0.1'"):
        load_experts(build(seed=2, uids=["ffn.0.1"]), tmp_path)

    torch.save({"hello": 1}, checkpoint_path(tmp_path, "ffn.0.1"))
    with pytest.raises(CheckpointError, match="not a swarm expert checkpoint"):
        load_experts(build(seed=2, uids=["ffn.0.1"]), tmp_path)

    save_experts(build(seed=1, uids=["ffn.0.0"]), tmp_path)
    wide = {"ffn.0.0": make_backend("ffn", "ffn.0.0", HID * 2)}
    before = wide["ffn.0.0"].module.ffn.weight.detach().clone()
    with pytest.raises(CheckpointError, match="does not fit expert ffn.0.0"):
        load_experts(wide, tmp_path)
    assert torch.equal(wide["ffn.0.0"].module.ffn.weight, before)  # unchanged, never half-loaded


def test_failed_save_keeps_the_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backends = build(seed=1, uids=["ffn.0.0"])
    (path,) = save_experts(backends, tmp_path)
    old = path.read_bytes()
    train(backends, steps=1, seed=0)

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(CheckpointError, match="could not save checkpoint of expert ffn.0.0"):
        save_experts(backends, tmp_path)
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["ffn.0.0.pt"]  # the temp file was removed


def test_checkpoint_path_rejects_unsafe_uids(tmp_path: Path) -> None:
    for uid in ("", "../x", ".hidden", "a/b"):
        with pytest.raises(ValueError, match="cannot name a checkpoint file"):
            checkpoint_path(tmp_path, uid)


def test_saver_saves_on_stop_and_periodically(tmp_path: Path) -> None:
    backends = build(seed=1)
    saver = CheckpointSaver(backends, tmp_path)
    with pytest.raises(RuntimeError, match="needs an interval"):
        saver.start()
    saver.stop()
    assert saver.saves == 1
    assert sorted(os.listdir(tmp_path)) == ["ffn.0.0.pt", "ffn.0.1.pt"]
    assert sorted(CheckpointSaver(build(seed=2), tmp_path).load()) == UIDS

    saved = threading.Event()
    periodic = CheckpointSaver(backends, tmp_path / "periodic", interval=0.01, on_save=lambda _: saved.set())
    periodic.start()
    try:
        assert saved.wait(10), "no periodic save happened"
    finally:
        periodic.stop(final_save=False)
    assert periodic.saves >= 1
    assert (tmp_path / "periodic" / "ffn.0.0.pt").exists()
    with pytest.raises(ValueError, match="interval"):
        CheckpointSaver(backends, tmp_path, interval=0)


def test_saver_skips_experts_that_did_not_change(tmp_path: Path) -> None:
    backends = build(seed=3)
    saver = CheckpointSaver(backends, tmp_path)
    assert len(saver.save(only_changed=True)) == 2  # never saved: both written
    assert saver.save(only_changed=True) == []
    train({"ffn.0.1": backends["ffn.0.1"]}, steps=1, seed=4)
    assert saver.save(only_changed=True) == [checkpoint_path(tmp_path, "ffn.0.1")]
    restored = CheckpointSaver(build(seed=5), tmp_path)
    assert sorted(restored.load()) == UIDS
    assert restored.save(only_changed=True) == []  # what was just loaded is what is on disk
    assert len(restored.save()) == 2  # unless asked for everything
