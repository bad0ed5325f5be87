"""A plain loop under accelerate: `swarm.Optimizer` takes the `accelerator.prepare`d model and optimizer."""

from __future__ import annotations

import threading

import pytest
import torch

accelerate = pytest.importorskip("accelerate", reason="the transformers extra (accelerate) is not installed")

from fast import FAST

from swarm.optim import Optimizer

pytestmark = pytest.mark.alone  # two peers average in this process against round deadlines


def test_two_accelerate_loops_take_identical_collective_steps(swarm_peers):
    # accelerate keeps one state per process, and a transformers Trainer made earlier in this
    # process (the suite's other integration tests) fixed it without bf16: start from a clean one
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    torch.manual_seed(0)
    data = torch.randn(256, 8), torch.randint(0, 4, (256,))
    models, opts = [], []
    for peer in swarm_peers(2):
        torch.manual_seed(1)
        module = torch.nn.Linear(8, 4)
        model, optimizer = accelerator.prepare(module, torch.optim.AdamW(module.parameters(), lr=0.05))
        models.append(model)
        opts.append(Optimizer(peer, "acc", model.parameters(), optimizer, target_batch_size=64, config=FAST))
    assert all(o.wait_for_peers(2, timeout=10) for o in opts)

    def train(model, opt, seed):
        g = torch.Generator().manual_seed(seed)
        while opt.epoch < 4:
            idx = torch.randint(0, 256, (16,), generator=g)
            with accelerator.autocast():
                loss = torch.nn.functional.cross_entropy(model(data[0][idx]), data[1][idx])
            accelerator.backward(loss)
            opt.step(16)
            opt.zero_grad()

    threads = [threading.Thread(target=train, args=(m, o, i)) for i, (m, o) in enumerate(zip(models, opts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert [o.epoch for o in opts] == [4, 4]
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    for o in opts:
        o.shutdown()
