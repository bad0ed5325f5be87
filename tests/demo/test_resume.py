"""The demo stopped entirely and started again with `--resume-from`: its trainer continues from the
checkpoint it saved when it stopped (epoch and weights), and its loss curve continues on the same
time axis, in the trainer's events and in the launcher's plot."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from swarm.checkpoint import CheckpointStore
from swarm.demo.events import Evaluation, Event, Notice, Progress
from swarm.demo.launcher import DemoConfig, Launcher
from swarm.demo.model import ModelConfig
from swarm.demo.trainer import Trainer, TrainerConfig


def config(**overrides: object) -> TrainerConfig:
    base = {"name": "trainer-0", "listen": "/ip4/127.0.0.1/tcp/0", "local_experts": True, "duration": 2.0,
            "batch_size": 4, "target_batch_size": 8, "mode": "large-batch", "report_every": 0.3, "eval_every": 0.7,
            "threads": 1, "model": ModelConfig(hidden_dim=32, heads=2)}
    return TrainerConfig(**{**base, **overrides})  # type: ignore[arg-type]


def run(cfg: TrainerConfig) -> tuple[Trainer, list[Event], list[torch.Tensor]]:
    events: list[Event] = []
    trainer = Trainer(cfg, events.append, threading.Event())
    try:
        at_start = [p.detach().clone() for p in trainer.model.dense_parameters()]
        trainer.train()
    finally:
        trainer.close()
    return trainer, events, at_start


def test_a_stopped_demo_resumes_its_weights_epoch_and_loss_curve(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    first, first_events, _ = run(config(checkpoint_dir=str(checkpoints), checkpoint_every=0.5))
    saved_epoch = first.optimizer.epoch
    assert saved_epoch > 0
    assert any(isinstance(e, Notice) and f"saved the run's state at epoch {saved_epoch}" in e.message
               for e in first_events)
    assert CheckpointStore(checkpoints).epochs()[0] == saved_epoch
    final_weights = [p.detach().clone() for p in first.model.dense_parameters()]
    last_time = max(e.elapsed for e in first_events if isinstance(e, Progress))

    second, events, at_start = run(config(checkpoint_dir=str(checkpoints), resume_from=str(checkpoints),
                                          duration=1.0))
    assert all(torch.equal(a, b) for a, b in zip(at_start, final_weights))  # the weights it stopped with
    assert second.curve.elapsed >= last_time  # the run's seconds so far
    progress = [e for e in events if isinstance(e, Progress)]
    assert progress[0].epoch >= saved_epoch
    assert min(e.elapsed for e in progress) > last_time  # the curve goes on, it does not start at 0 again
    assert min(e.elapsed for e in events if isinstance(e, Evaluation)) >= second.curve.elapsed
    # the next checkpoint keeps the curve before the stop and after it
    kept = second.curve.curves["trainer-0"]
    assert kept[0][0] < last_time < kept[-1][0]

    launcher = Launcher(DemoConfig(trainers=1, out_dir=tmp_path / "out", resume_from=checkpoints))
    assert launcher.curves["trainer-0"] == kept and launcher.evals == second.curve.evals
