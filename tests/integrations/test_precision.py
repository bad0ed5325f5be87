"""Mixed precision in a swarm: bf16 autocast on CPUs under both frameworks, and what fp16 does without CUDA.

A lone peer whose target batch is one local batch takes a collective step per local step: the forward
runs in the autocast dtype while the parameters, the gradients the swarm averages and its step stay
float32.
"""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
pytest.importorskip("datasets", reason="the transformers extra is not installed")

from fast import FAST
from gpt2_common import byte_corpus, tiny_gpt2

from swarm.integrations.session import SwarmArguments

STEPS = 3


def _swarm(run_id: str) -> SwarmArguments:
    return SwarmArguments(run_id=run_id, target_batch_size=8, collaboration=FAST, listen="/ip4/127.0.0.1/tcp/0")


def _logits_dtypes(model) -> list[torch.dtype]:
    """The dtypes the output layer computes in (inside the model: accelerate converts what the model
    returns back to float32)."""
    seen: list[torch.dtype] = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    return seen


def _train_trainer(tmp_path, **precision: bool) -> tuple[list[torch.dtype], torch.nn.Module, list[torch.Tensor], int]:
    from swarm.integrations.transformers import SwarmTrainer

    train, _ = byte_corpus(32, limit=20_000)
    model = tiny_gpt2(context=32)
    before = [p.detach().clone() for p in model.parameters()]
    seen = _logits_dtypes(model)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=STEPS,
                                          learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
                                          disable_tqdm=True, **precision)
    trainer = SwarmTrainer(model=model, args=args, train_dataset=train, swarm=_swarm("precision-hf"))
    trainer.train()
    return seen, model, before, trainer.state.global_step


def test_the_trainer_autocasts_to_bf16_on_a_cpu_and_the_swarm_steps_in_float32(tmp_path):
    seen, model, before, steps = _train_trainer(tmp_path, bf16=True)
    assert steps == STEPS and seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()) if b.requires_grad)


def test_fp16_on_a_cpu_trains_in_float32_and_the_trainer_says_so(tmp_path, caplog):
    # transformers (with accelerate) neither autocasts nor scales the loss for fp16 on a CPU
    with caplog.at_level(logging.WARNING, logger="swarm.integrations.transformers"):
        seen, _, _, steps = _train_trainer(tmp_path, fp16=True)
    assert steps == STEPS and set(seen) == {torch.float32}
    assert "fp16=True on a CPU" in caplog.text


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_autocasts_to_bf16_on_a_cpu(precision):
    pl = pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")
    from gpt2_lightning import CausalLM
    from torch.utils.data import DataLoader

    from swarm.integrations.lightning import SwarmStrategy

    train, _ = byte_corpus(32, limit=20_000)
    module = CausalLM(STEPS)  # the Lightning example's module
    seen = _logits_dtypes(module.model)
    before = [p.detach().clone() for p in module.parameters()]
    strategy = SwarmStrategy(_swarm(f"precision-{precision}"), device="cpu", max_collective_steps=STEPS)
    trainer = pl.Trainer(strategy=strategy, precision=precision, max_steps=10 * STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    # "16-mixed": Lightning has no fp16 autocast on CPUs and switches to bf16-mixed (with a warning)
    trainer.fit(module, DataLoader(train, batch_size=8, sampler=strategy.sampler(len(train))))
    assert strategy.global_step == STEPS and seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
