"""`swarm.Optimizer(..., checkpoint=..., resume_from=...)` on real peers: the run's state saved
after collective steps, a cold restart on a fresh peer that continues bit for bit from the newest
checkpoint, and saves into a full filesystem that leave training and the earlier checkpoints alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from optim_task import DATA_SIZE, adam, loss_on, make_data, make_model
from tmpfs import small_tmpfs

from swarm.checkpoint import CheckpointRefused, CheckpointStore
from swarm.optim import CollaborationConfig, Optimizer
from swarm.optim.checkpointing import CheckpointConfig
from swarm.peer import Peer

RUN = "ckpt"
CONFIG = CollaborationConfig(target_batch_size=32, report_period=0.1, max_refresh_period=0.5,
                             progress_expiration=2.0, averaging_timeout=5.0)


@pytest.fixture
def lone_peer() -> Iterator[Peer]:
    """A peer alone in its swarm (a cold start: nobody else holds the run's state)."""
    peer = Peer(listen="/ip4/127.0.0.1/tcp/0")
    yield peer
    peer.shutdown()


def make_optimizer(peer: Peer, model: torch.nn.Module, checkpoint: CheckpointConfig,
                   resume_from: Path | None = None) -> Optimizer:
    return Optimizer(peer, run_id=RUN, params=model.parameters(), optimizer=adam, batch_size_per_step=16,
                     config=CONFIG, scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, 0.9),
                     checkpoint=checkpoint, resume_from=resume_from)


def train_until(opt: Optimizer, model: torch.nn.Module, epoch: int, seed: int = 0, keep_up: bool = False) -> None:
    """Trains to `epoch`; with `keep_up`, waits after each step for the save being written (a save
    due while the last one is still being written is skipped: here steps are faster than writes)."""
    x, y = make_data()
    g = torch.Generator().manual_seed(seed)
    for _ in range(200):  # bounded: alone, a step every two batches
        if opt.epoch >= epoch:
            return
        idx = torch.randint(0, DATA_SIZE, (16,), generator=g)
        loss_on(model, x[idx], y[idx]).backward()
        opt.step()
        opt.zero_grad()
        if keep_up and opt.checkpointer is not None:
            assert opt.checkpointer.wait(10)
    raise AssertionError(f"stuck at epoch {opt.epoch}")


def names(model: torch.nn.Module) -> tuple[str, ...]:
    return tuple(name for name, _ in model.named_parameters())


def test_a_cold_restart_on_a_fresh_peer_continues_bit_for_bit_from_the_newest_checkpoint(tmp_path: Path) -> None:
    model = make_model()
    config = CheckpointConfig(tmp_path, every_epochs=1, keep=2, param_names=names(model))
    with Peer(listen="/ip4/127.0.0.1/tcp/0") as first:
        opt = make_optimizer(first, model, config)
        train_until(opt, model, 3, keep_up=True)
        assert opt.checkpointer is not None and opt.checkpointer.wait(10)
        saved = [p.detach().clone() for p in model.parameters()]
        saved_adam = opt.optimizer.state_dict()
        saved_lr = opt.optimizer.param_groups[0]["lr"]
        opt.shutdown()
    assert CheckpointStore(tmp_path).epochs() == [3, 2]  # the last two kept

    resumed_model = make_model(seed=5)  # other initial weights: the checkpoint replaces them
    with Peer(listen="/ip4/127.0.0.1/tcp/0") as second:
        opt = make_optimizer(second, resumed_model, config, resume_from=tmp_path)
        assert opt.epoch == 3
        for mine, theirs in zip(resumed_model.parameters(), saved):
            assert torch.equal(mine, theirs)
        state = opt.optimizer.state_dict()
        for index, moments in saved_adam["state"].items():
            for key, value in moments.items():
                assert torch.equal(state["state"][index][key], value), key
        assert opt.optimizer.param_groups[0]["lr"] == saved_lr  # the scheduler's place too
        train_until(opt, resumed_model, 4, seed=1, keep_up=True)  # the swarm goes on from there
        assert opt.checkpointer is not None and opt.checkpointer.wait(10)
        opt.shutdown()
    assert CheckpointStore(tmp_path).epochs() == [4, 3]


def test_a_checkpoint_of_another_model_is_refused_at_start(tmp_path: Path, lone_peer: Peer) -> None:
    model = make_model()
    opt = make_optimizer(lone_peer, model, CheckpointConfig(tmp_path))
    train_until(opt, model, 1)
    assert opt.save_checkpoint() is not None
    opt.shutdown()
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    with pytest.raises(CheckpointRefused, match=r"another model: parameter 0 is 'param.0' F32\[16, 8\] there"):
        Optimizer(lone_peer, run_id=RUN, params=wider.parameters(), optimizer=adam, config=CONFIG,
                  resume_from=tmp_path)


def test_an_empty_resume_directory_starts_afresh(tmp_path: Path, lone_peer: Peer) -> None:
    model = make_model()
    opt = make_optimizer(lone_peer, model, CheckpointConfig(tmp_path / "ckpts"), resume_from=tmp_path / "ckpts")
    assert opt.epoch == 0
    opt.shutdown()


def test_saves_into_a_full_filesystem_fail_but_training_goes_on_and_older_checkpoints_stay(
        tmp_path: Path, lone_peer: Peer) -> None:
    from swarm.metrics import REGISTRY

    failed = REGISTRY.counter("swarm_checkpoint_saves_total", "Checkpoint saves of a run's state", ("outcome",))
    before = failed.labels(outcome="failed")._value.get()
    with small_tmpfs(tmp_path / "full", size="64k") as where:
        model = make_model()
        opt = make_optimizer(lone_peer, model, CheckpointConfig(where, every_epochs=1, keep=5))
        train_until(opt, model, 1)
        assert opt.checkpointer is not None and opt.checkpointer.wait(10)
        assert CheckpointStore(where).epochs() == [1]
        filler = where / "filler"
        with open(filler, "wb") as f:  # fill what is left
            try:
                f.write(bytes(64 << 10))
            except OSError:
                pass
        train_until(opt, model, 4, keep_up=True)  # the saves of epochs 2..4 fail; the steps do not
        assert opt.checkpointer.wait(10)
        assert opt.checkpointer.failures >= 1 and opt.checkpointer.last_error is not None
        assert opt.checkpointer.last_error.errno == 28  # ENOSPC
        assert failed.labels(outcome="failed")._value.get() >= before + 1
        assert CheckpointStore(where).epochs() == [1]
        assert CheckpointStore(where).load_newest(RUN).epoch == 1  # intact
        assert [e.name for e in where.iterdir() if e.name.startswith(".tmp")] == []
        opt.shutdown()


def test_a_trainer_that_does_not_name_its_parameters_resumes_from_a_named_checkpoint(
        tmp_path: Path, lone_peer: Peer) -> None:
    model = make_model()
    opt = make_optimizer(lone_peer, model, CheckpointConfig(tmp_path, param_names=names(model)))
    train_until(opt, model, 2)
    assert opt.save_checkpoint() is not None
    saved_epoch = opt.epoch
    opt.shutdown()
    # the demo's other trainers: they save nothing, so they know no names; dtypes and shapes decide
    resumed = make_model(seed=5)
    opt = Optimizer(lone_peer, run_id=RUN, params=resumed.parameters(), optimizer=adam, config=CONFIG,
                    resume_from=tmp_path)
    assert opt.epoch == saved_epoch
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), model.parameters()))
    opt.shutdown()


def test_a_new_optimizer_of_the_same_peer_and_run_resumes_and_steps_alone_at_once(
        tmp_path: Path, lone_peer: Peer) -> None:
    """A restart inside one process (what a notebook does): the first optimizer's withdrawn record
    is not taken for another peer to wait for; the second one resumes and steps alone at once."""
    model = make_model()
    config = CheckpointConfig(tmp_path, every_epochs=1, param_names=names(model))
    first = make_optimizer(lone_peer, model, config)
    train_until(first, model, 2, keep_up=True)
    first.shutdown()
    second = make_optimizer(lone_peer, model, config, resume_from=tmp_path)
    assert second.epoch == 2
    x, y = make_data()
    rounds = []
    for i in range(4):  # two batches of 16 per collective step of 32
        loss_on(model, x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)]).backward()
        outcome = second.step()
        second.zero_grad()
        if outcome.round is not None:
            rounds.append(outcome.round)
    assert second.epoch == 4
    assert [(r.ok, r.group_size, r.error) for r in rounds] == [(True, 1, None)] * 2, rounds
    second.shutdown()
