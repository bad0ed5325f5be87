"""Lightning in a swarm: three peers with `SwarmStrategy` train a tiny GPT-2 to identical parameters."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")
pytest.importorskip("transformers", reason="the example model needs the transformers extra")
pytest.importorskip("datasets", reason="the example corpus needs the transformers extra")

from fast import FAST
from gpt2_common import InThreads, byte_corpus, held_out_loss, tiny_gpt2
from torch.utils.data import DataLoader

from swarm.integrations.lightning import SwarmStrategy
from swarm.integrations.session import SwarmArguments

pytestmark = pytest.mark.alone  # several peers average in this process against round deadlines

STEPS = 12


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_gpt2(context=32)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1 - step / STEPS))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def test_three_lightning_peers_reach_identical_parameters_and_a_lower_loss(swarm_peers):
    train, held_out = byte_corpus(32, limit=150_000)
    modules = [CausalLM() for _ in range(3)]
    before = held_out_loss(modules[0].model, held_out)
    runs = []
    for peer, module in zip(swarm_peers(3), modules):
        strategy = SwarmStrategy(SwarmArguments(run_id="pl", target_batch_size=48, collaboration=FAST, min_peers=3,
                                                peers_timeout=30), peer=peer, max_collective_steps=STEPS,
                                 max_grad_norm=1.0)
        loader = DataLoader(train, batch_size=8, sampler=strategy.sampler(len(train)))
        trainer = pl.Trainer(strategy=strategy, max_steps=10 * STEPS, accumulate_grad_batches=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        runs.append((trainer, module, loader, strategy))
    InThreads([lambda r=r: r[0].fit(r[1], r[2]) for r in runs]).join(90)
    first = list(modules[0].parameters())
    for other in modules[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, other.parameters()))
    # the scheduler configure_optimizers returned stepped with the swarm: at zero after STEPS steps
    assert runs[0][3].optimizers[0].param_groups[0]["lr"] == 0.0
    after = held_out_loss(modules[0].model, held_out)
    assert after < before - 0.5, (before, after)


def test_a_lightning_checkpoint_resumes_the_swarm_state_and_the_data_position(swarm_peers, tmp_path):
    train, _ = byte_corpus(32, limit=60_000)
    (peer,) = swarm_peers(1)
    args = SwarmArguments(run_id="pl-resume", target_batch_size=8, collaboration=FAST)

    def fit(steps: int, ckpt_path=None):
        strategy = SwarmStrategy(args, peer=peer, max_collective_steps=steps)
        loader = DataLoader(train, batch_size=8, sampler=strategy.sampler(len(train)))
        saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
        trainer = pl.Trainer(strategy=strategy, max_steps=100, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[saver])
        trainer.fit(CausalLM(), loader, ckpt_path=ckpt_path)
        return strategy

    fit(6)
    checkpoints = sorted(tmp_path.glob("*.ckpt"))
    assert checkpoints, "no checkpoint was written"
    saved = torch.load(checkpoints[0], weights_only=False)["optimizer_states"][0]
    assert saved["swarm_optimizer"]["metadata"]["epoch"] == 4 and saved["sampler"]["offset"] >= 4 * 8
    resumed = fit(8, ckpt_path=str(checkpoints[0]))
    # it went on from the checkpoint's swarm step (4) to 8, and from the checkpoint's place in the data
    assert resumed.global_step == 8
    # (4 batches of 8, and at most two more the loader fetched ahead)
    assert resumed._sampler is not None
    assert saved["sampler"]["offset"] + 4 * 8 <= resumed._sampler.position <= saved["sampler"]["offset"] + 6 * 8
