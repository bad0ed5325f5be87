"""The demo trainer survives a held-out evaluation that finds no expert answering (a server
restarting): it reports a notice instead of dying with a traceback (found by the network lab's
chaos scenario, docs/network-lab.md)."""

from __future__ import annotations

import threading

from swarm.demo.events import Evaluation, Notice
from swarm.demo.model import ModelConfig
from swarm.demo.trainer import Trainer, TrainerConfig


def test_an_evaluation_without_experts_is_a_notice_not_a_crash() -> None:
    events: list[object] = []
    # a lone peer on loopback: its mixture layer has no expert server to reach
    config = TrainerConfig(name="lone", listen="/ip4/127.0.0.1/tcp/0", model=ModelConfig())
    trainer = Trainer(config, events.append, threading.Event())
    try:
        trainer.report_evaluation(0.0)
    finally:
        trainer.close()
    notices = [e.message for e in events if isinstance(e, Notice) and not e.message.startswith("mode: ")]
    assert not any(isinstance(e, Evaluation) for e in events)
    assert len(notices) == 1 and "skipped a held-out evaluation" in notices[0], notices
