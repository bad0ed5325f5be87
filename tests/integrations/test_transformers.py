"""transformers' Trainer in a swarm: three peers train a tiny GPT-2 to identical parameters and a lower loss."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
pytest.importorskip("datasets", reason="the transformers extra is not installed")

from fast import FAST
from gpt2_common import InThreads, byte_corpus, held_out_loss, tiny_gpt2

from swarm.compression import CompressionType
from swarm.integrations.session import SwarmArguments
from swarm.integrations.transformers import SwarmCallback, SwarmTrainer
from swarm.optim import DiLoCoConfig

pytestmark = pytest.mark.alone  # several peers average in this process against round deadlines

STEPS = 12


def _trainer(peer, model, train, out, run_id="hf") -> SwarmTrainer:
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=1.0, logging_steps=4,
        save_steps=6, report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    return SwarmTrainer(model=model, args=args, train_dataset=train, peer=peer,
                        swarm=SwarmArguments(run_id=run_id, target_batch_size=48, collaboration=FAST, min_peers=3,
                                             peers_timeout=30))


def test_three_trainers_reach_identical_parameters_and_a_lower_loss(swarm_peers, tmp_path):
    train, held_out = byte_corpus(32, limit=150_000)
    models = [tiny_gpt2(context=32) for _ in range(3)]
    before = held_out_loss(models[0], held_out)
    trainers = [_trainer(p, m, train, str(tmp_path / f"p{i}")) for i, (p, m) in enumerate(zip(swarm_peers(3), models))]
    InThreads([t.train for t in trainers]).join(90)  # raises a trainer's error, or if one did not end
    # max_steps counts the swarm's steps: every trainer stopped at the same collective step
    assert [t.state.global_step for t in trainers] == [STEPS] * 3
    first = list(models[0].parameters())
    for other in models[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, other.parameters()))
    after = held_out_loss(models[0], held_out)
    assert after < before - 0.5, (before, after)
    # the schedule stepped with the swarm: linear decay to zero at max_steps
    logged = [h for h in trainers[0].state.log_history if "learning_rate" in h and "loss" in h]
    assert logged and logged[-1]["step"] == STEPS and logged[-1]["learning_rate"] == 0.0
    # checkpoints at save_steps of the swarm's count, each with the swarm's state in optimizer.pt
    saved = sorted(p.name for p in (tmp_path / "p0").iterdir() if p.name.startswith("checkpoint-"))
    assert saved == ["checkpoint-12", "checkpoint-6"]
    state = torch.load(tmp_path / "p0" / "checkpoint-6" / "optimizer.pt", weights_only=True)
    assert state["swarm_optimizer"]["metadata"]["epoch"] == 6 and state["sampler"]["offset"] > 0


def test_three_trainers_in_diloco_mode_share_the_outer_parameters(swarm_peers, tmp_path):
    train, held_out = byte_corpus(32, limit=150_000)
    models = [tiny_gpt2(context=32) for _ in range(3)]
    before = held_out_loss(models[0], held_out)
    ends: list[tuple[int, list[torch.Tensor]]] = []

    class KeepShared(transformers.TrainerCallback):
        def __init__(self, trainer_of) -> None:
            self.trainer_of = trainer_of

        def on_train_end(self, args, state, control, **kwargs):
            opt = self.trainer_of().session.optimizer
            ends.append((opt.epoch, [t.detach().clone() for t in opt.shared_tensors]))

    trainers: list[SwarmTrainer] = []
    for i, (peer, model) in enumerate(zip(swarm_peers(3), models)):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"p{i}"), per_device_train_batch_size=8, max_steps=16, learning_rate=3e-3, bf16=True,
            save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=1000)
        trainer = SwarmTrainer(model=model, args=args, train_dataset=train, peer=peer, swarm=SwarmArguments(
            run_id="hf-diloco", diloco=DiLoCoConfig(local_steps=4, compression=CompressionType.NONE),
            collaboration=FAST, min_peers=3, peers_timeout=30))
        trainer.add_callback(KeepShared(lambda t=trainer: t))
        trainers.append(trainer)
    InThreads([t.train for t in trainers]).join(90)
    assert len(ends) == 3
    # max_steps counts the swarm's inner steps: 16 inner steps are 4 rounds of 4
    assert [t.state.global_step for t in trainers] == [16] * 3 and {epoch for epoch, _ in ends} == {4}
    for _, shared in ends[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ends[0][1], shared))
    outer = tiny_gpt2(context=32)
    with torch.no_grad():
        for p, value in zip(outer.parameters(), ends[0][1]):
            p.copy_(value)
    assert held_out_loss(outer, held_out) < before - 0.3


def test_a_trainer_with_another_vocabulary_is_refused_before_it_trains(swarm_peers, tmp_path):
    from swarm.integrations.fingerprint import ModelMismatchError
    from swarm.integrations.session import SwarmSession
    from swarm.integrations.transformers import fingerprint_of

    train, _ = byte_corpus(32, limit=20_000)
    running_peer, newcomer_peer = swarm_peers(2)
    model = tiny_gpt2(context=32)
    swarm = SwarmArguments(run_id="hf-door", target_batch_size=16, collaboration=FAST)
    running = SwarmSession(swarm, model, torch.optim.AdamW(model.parameters()), peer=running_peer,
                           fingerprint=fingerprint_of(model))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=4,
                                          save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    other = tiny_gpt2(context=32, vocab=300)
    newcomer = SwarmTrainer(model=other, args=args, train_dataset=train, swarm=swarm, peer=newcomer_peer)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(ModelMismatchError, match="vocab_size 300 here vs 256 there"):
        newcomer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # it took no step
    assert running.optimizer.progress.num_peers == 1  # and never reported progress to the run
    running.shutdown()


def test_a_trainer_is_built_without_warnings_and_with_its_step_callbacks_first_and_last(tmp_path):
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append  # type: ignore[method-assign]
    log = transformers.utils.logging.get_logger("transformers")
    log.addHandler(handler)
    try:
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=4,
                                              report_to=[], use_cpu=True)
        trainer = SwarmTrainer(model=tiny_gpt2(context=32), args=args, train_dataset=byte_corpus(32, limit=2_000)[0],
                               swarm=SwarmArguments(run_id="built", target_batch_size=48))
    finally:
        log.removeHandler(handler)
    assert not warnings, [w.getMessage()[:200] for w in warnings]
    callbacks = trainer.callback_handler.callbacks
    assert isinstance(callbacks[0], SwarmCallback) and callbacks[0].first
    assert isinstance(callbacks[-1], SwarmCallback) and not callbacks[-1].first


def test_epochs_count_passes_of_the_whole_swarm_over_the_data(tmp_path):
    train, _ = byte_corpus(32, limit=20_000)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=3,
                                          report_to=[], use_cpu=True)
    trainer = SwarmTrainer(model=tiny_gpt2(context=32), args=args, train_dataset=train,
                           swarm=SwarmArguments(run_id="epochs", target_batch_size=48))
    # 3 passes of the swarm over len(train) samples, 48 per collective step
    assert trainer._collective_max_steps(args) == -(-3 * len(train) // 48)
