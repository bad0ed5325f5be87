"""A peer that misses one round catches up from that round's result instead of downloading the state.

Real peers on loopback: two train round 0 without the third (it reports progress, so the round
expects it, but it takes no batch), and the third then steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from optim_task import DATA_SIZE, adam, loss_on, make_data, make_model

from swarm.compression import CompressionType
from swarm.optim import CollaborationConfig, Optimizer
from swarm.optim.progress import PeerProgress, majority_digest
from swarm.optim.state_transfer import _checked_result
from swarm.peer import Peer

BATCH = 16
FAST = CollaborationConfig(target_batch_size=64, report_period=0.05, min_refresh_period=0.02,
                           max_refresh_period=0.2, averaging_timeout=10.0, gradient_compression=CompressionType.NONE)


def _train_until(opt: Optimizer, model: torch.nn.Module, epoch: int, seed: int) -> None:
    x, y = make_data()
    g = torch.Generator().manual_seed(seed)
    for _ in range(200):  # bounded: round 0 needs 4 batches of the two peers together
        if opt.epoch >= epoch:
            return
        idx = torch.randint(0, DATA_SIZE, (BATCH,), generator=g)
        loss_on(model, x[idx], y[idx]).backward()
        opt.step(BATCH)
        opt.zero_grad()
        if opt._in_flight is not None:
            opt.flush()  # rounds overlapped: land it now, before another batch could launch the next


def _take_round_zero(opts: list[Optimizer], models: list[torch.nn.Module], seed: int) -> None:
    """Each of `opts` trains in its own thread until round 0 has landed."""
    threads = [threading.Thread(target=_train_until, args=(o, m, 1, seed + i))
               for i, (o, m) in enumerate(zip(opts, models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)


def _round_without_the_third(make_peer, run_id: str, config: CollaborationConfig,
                             late: Callable[[Peer], Peer] | None = None):
    """Three peers in sync at epoch 0 (the third on `late` when given); the first two take round 0
    without the third."""
    models = [make_model() for _ in range(3)]
    peers = [make_peer(), make_peer()]
    peers.append(late(peers[0]) if late is not None else make_peer())
    opts = [Optimizer(p, run_id=run_id, params=m.parameters(), optimizer=adam, config=config)
            for p, m in zip(peers, models)]
    assert all(o.wait_for_peers(3, timeout=10) for o in opts)
    _take_round_zero(opts[:2], models[:2], seed=10)
    assert opts[0].epoch == opts[1].epoch == 1 and opts[2].epoch == 0
    first = opts[0].history[0]
    assert first.ok and first.epoch == 0 and first.contributors == 2, first
    # the third must learn that the swarm moved on before it steps
    assert opts[2].tracker.wait_for(lambda p: p.epoch >= 1, timeout=10)
    return models, opts


def _third_steps(opts, models):
    x, y = make_data(seed=1)
    loss_on(models[2], x[:BATCH], y[:BATCH]).backward()
    out = opts[2].step(BATCH)
    opts[2].zero_grad()
    return out


def _same_state(a: Optimizer, b: Optimizer) -> bool:
    state_a, state_b = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    return (all(torch.equal(p, q) for p, q in zip(a.shared_tensors, b.shared_tensors))
            and all(torch.equal(state_a[i][k], state_b[i][k]) for i in state_a for k in ("exp_avg", "exp_avg_sq")))


@pytest.mark.parametrize("staleness, client", [(0, False), (1, False), (0, True)])
def test_a_peer_that_missed_one_round_takes_its_step_from_the_result_not_the_state(make_peer, staleness, client):
    # a client-mode peer (a notebook behind NAT) serves nothing, but dials out to a member for the result
    clients: list[Peer] = []

    def late_client(first: Peer) -> Peer:
        clients.append(Peer(initial_peers=first.addrs, client_mode=True))
        return clients[-1]

    try:
        models, opts = _round_without_the_third(make_peer, f"catch{staleness}{client:d}",
                                                replace(FAST, max_staleness=staleness),
                                                late_client if client else None)
        out = _third_steps(opts, models)
        _check_caught_up(opts, out, staleness)
    finally:
        for peer in clients:
            peer.shutdown()


def _check_caught_up(opts, out, staleness: int) -> None:
    assert out.caught_up and not out.state_loaded and out.stepped, out
    assert opts[2].epoch == 1
    # the same step as the members took, bit for bit: parameters and Adam's moments
    assert _same_state(opts[2], opts[0]) and _same_state(opts[2], opts[1])
    # the batch it computed before catching up was one epoch old: taken in when rounds may be one
    # step late (towards round 1, which it may have launched already), dropped when every round
    # is waited for
    assert opts[2].samples_total == (BATCH if staleness else 0)
    assert out.discarded_samples == 0


def test_a_result_that_does_not_give_the_swarms_state_is_refused_and_the_state_downloaded(make_peer):
    models, opts = _round_without_the_third(make_peer, "liar", replace(FAST, max_staleness=0))
    # both members serve a wrong mean (finite, the right shapes): the state it gives has another
    # fingerprint than the one the members report at epoch 1
    for member in opts[:2]:
        epoch, tensors = member._kept_result
        member._kept_result = (epoch, [t * 2 + 0.01 for t in tensors])
    out = _third_steps(opts, models)
    assert out.state_loaded and not out.caught_up, out
    assert opts[2].epoch == 1 and _same_state(opts[2], opts[0])


def test_a_member_that_kept_no_result_sends_the_late_peer_to_the_state(make_peer):
    models, opts = _round_without_the_third(make_peer, "nokeep", replace(FAST, max_staleness=0))
    for member in opts[:2]:
        member._kept_result = None
    out = _third_steps(opts, models)
    assert out.state_loaded and not out.caught_up, out
    assert _same_state(opts[2], opts[0])


def test_a_round_every_expected_peer_joined_keeps_no_result(make_peer):
    models = [make_model() for _ in range(2)]
    opts = [Optimizer(make_peer(), run_id="full", params=m.parameters(), optimizer=adam,
                      config=replace(FAST, max_staleness=0)) for m in models]
    assert all(o.wait_for_peers(2, timeout=10) for o in opts)
    _take_round_zero(opts, models, seed=20)
    assert all(o.epoch == 1 and o.history[0].contributors == 2 for o in opts)
    assert all(o._kept_result is None for o in opts)  # no copy of the mean for nobody


# -- pure checks ---------------------------------------------------------------------------------

LIKE = [torch.zeros(3, 2), torch.zeros(4)]


def test_a_result_of_another_round_or_shape_or_holding_nan_is_refused():
    good = [torch.ones(3, 2), torch.ones(4)]
    assert _checked_result({"epoch": 5}, good, 5, LIKE) == good
    with pytest.raises(ValueError, match="round 6"):
        _checked_result({"epoch": 6}, good, 5, LIKE)
    with pytest.raises(ValueError, match="round None"):
        _checked_result(["epoch", 5], good, 5, LIKE)
    with pytest.raises(ValueError, match="1 tensors"):
        _checked_result({"epoch": 5}, good[:1], 5, LIKE)
    with pytest.raises(ValueError, match="expected torch.float32"):
        _checked_result({"epoch": 5}, [torch.ones(2, 3), torch.ones(4)], 5, LIKE)
    with pytest.raises(ValueError, match="expected torch.float32"):
        _checked_result({"epoch": 5}, [torch.ones(3, 2, dtype=torch.float64), torch.ones(4)], 5, LIKE)
    with pytest.raises(ValueError, match="NaN or Inf"):
        _checked_result({"epoch": 5}, [torch.ones(3, 2), torch.tensor([1.0, float("inf"), 0.0, 0.0])], 5, LIKE)


def _report(peer: str, epoch: int, digest: str) -> PeerProgress:
    return PeerProgress(peer_id=peer, epoch=epoch, samples=0, samples_per_second=0.0, time=0.0, digest=digest)


def test_the_majority_digest_is_the_one_most_peers_at_the_epoch_report():
    reports = [_report("a", 3, "x"), _report("b", 3, "y"), _report("c", 3, "y"), _report("d", 2, "z"),
               _report("e", 2, "z"), _report("f", 3, "")]
    assert majority_digest(reports, 3) == "y"
    assert majority_digest(reports, 2) == "z"
    assert majority_digest(reports, 4) is None
    assert majority_digest([_report("a", 1, "q"), _report("b", 1, "p")], 1) == "p"  # ties: the smaller
