"""DiLoCo mode: local steps, averaged pseudo-gradients, outer Nesterov steps; it converges."""

from __future__ import annotations

import threading

import torch
from optim_task import DATA_SIZE, loss_on, make_data, make_model

from swarm.compression import CompressionType
from swarm.optim import CollaborationConfig, DiLoCoConfig, Optimizer

FAST = CollaborationConfig(report_period=0.05, min_refresh_period=0.02, max_refresh_period=0.2,
                           averaging_timeout=10.0)


def inner(params):
    return torch.optim.Adam(params, lr=0.01)


def test_diloco_converges_and_keeps_peers_identical(make_peer):
    x, y = make_data()
    held_x, held_y = make_data(seed=1)
    models = [make_model() for _ in range(2)]
    diloco = DiLoCoConfig(local_steps=10, outer_lr=0.7, outer_momentum=0.9,
                          compression=CompressionType.UNIFORM_8BIT)
    opts = [Optimizer(make_peer(), run_id="dl", params=m.parameters(), optimizer=inner, diloco=diloco,
                      config=FAST) for m in models]
    assert all(o.wait_for_peers(2, timeout=10) for o in opts)
    with torch.no_grad():
        initial = loss_on(models[0], held_x, held_y).item()
    rounds = 8
    snapshots: list[dict[int, list[torch.Tensor]]] = [{}, {}]

    def run(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        opt, model = opts[i], models[i]
        while opt.epoch < rounds:
            idx = torch.randint(0, DATA_SIZE, (16,), generator=g)
            loss_on(model, x[idx], y[idx]).backward()
            out = opt.step(16)
            opt.zero_grad()
            if out.round is not None and out.round.ok:
                snapshots[i][opt.epoch] = [p.detach().clone() for p in model.parameters()]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for epoch in range(1, rounds + 1):
        assert all(torch.equal(a, b) for a, b in zip(snapshots[0][epoch], snapshots[1][epoch])), epoch
    with torch.no_grad():
        final = loss_on(models[0], held_x, held_y).item()
    assert final < 0.3 * initial, (initial, final)
    assert all(h.ok and h.group_size == 2 for o in opts for h in o.history)
