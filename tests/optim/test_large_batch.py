"""Large-batch mode: peers take identical steps, equal to one process with the same total batch."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import replace

import pytest
import torch
from optim_task import DATA_SIZE, adam, loss_on, make_data, make_model, reference_params, replay_delayed

from swarm.averaging import Action, Averager, FaultPlan, FaultPoint
from swarm.averaging.state import load_state_from_peers
from swarm.compression import CompressionType
from swarm.dht import owner_marker
from swarm.optim import CollaborationConfig, Optimizer
from swarm.optim.group_averaging import SwarmAverager
from swarm.optim.training_state import TrainingState

BATCH = 16
TARGET = 64
# gradients uncompressed on the wire, so the peers' steps can be checked against one process's exactly
FAST = CollaborationConfig(target_batch_size=TARGET, report_period=0.05, min_refresh_period=0.02,
                           max_refresh_period=0.2, averaging_timeout=10.0, gradient_compression=CompressionType.NONE)
SYNC = replace(FAST, max_staleness=0)  # every round waited for: exactly one process's steps


def train(opt: Optimizer, model: torch.nn.Module, data, seed: int, epochs: int, record: dict) -> None:
    x, y = data
    g = torch.Generator().manual_seed(seed)
    pending: list[int] = []
    while opt.epoch < epochs:
        idx = torch.randint(0, DATA_SIZE, (BATCH,), generator=g)
        loss_on(model, x[idx], y[idx]).backward()
        epoch = opt.epoch
        out = opt.step(BATCH)
        opt.zero_grad()
        if out.state_loaded:
            pending = []
            continue
        pending += idx.tolist()
        if out.round is not None and out.round.ok:
            record.setdefault("epochs", {})[epoch] = pending
            record.setdefault("params", {})[opt.epoch] = [p.detach().clone() for p in model.parameters()]
            pending = []


# the default wire format (SCALED_FLOAT16) rounds each gradient to half precision: the peers still
# take identical steps, and stay within its rounding of one process's (6.8e-5 at most measured over
# these 6 Adam steps at lr 0.05; a step's update is 0.05 per parameter, so a wrong mean is far outside)
@pytest.mark.parametrize("num_peers, codec, tolerance", [
    (2, CompressionType.NONE, 1e-5), (4, CompressionType.NONE, 1e-5),
    (4, CollaborationConfig.gradient_compression, 1e-3)])
def test_peers_take_identical_steps_equal_to_one_process(make_peer, num_peers, codec, tolerance):
    data = make_data()
    epochs = 6
    models = [make_model() for _ in range(num_peers)]
    config = replace(SYNC, gradient_compression=codec)
    opts = [Optimizer(make_peer(), run_id="lb", params=m.parameters(), optimizer=adam, config=config) for m in models]
    assert all(o.wait_for_peers(num_peers, timeout=10) for o in opts)
    records: list[dict] = [{} for _ in range(num_peers)]
    threads = [threading.Thread(target=train, args=(o, m, data, 100 + i, epochs, r))
               for i, (o, m, r) in enumerate(zip(opts, models, records))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for epoch in range(1, epochs + 1):
        first = records[0]["params"][epoch]
        for r in records[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first, r["params"][epoch])), f"peers differ at {epoch}"
    epoch_samples = [list(itertools.chain.from_iterable(r["epochs"][e] for r in records)) for e in range(epochs)]
    # a round starts when the peers' reports, extrapolated by each peer's throughput since its
    # report, reach the target (swarm.optim.progress.summarize, its arithmetic tested in
    # test_progress_state.py): a round may hold fewer samples than the target (a report
    # extrapolated past what its peer computed) or more, by as much as the machine's load skews
    # the throughputs, so how many samples a round holds is a timing figure, not asserted here.
    # What holds: every peer takes part in every round, and each step is exactly one process's
    # step on the samples the round held (below)
    sizes = [len(s) for s in epoch_samples]
    assert all(len(r["epochs"][e]) > 0 for r in records for e in range(epochs)), sizes
    expected = reference_params(epoch_samples, data)
    for got, want in zip(models[0].parameters(), expected):
        torch.testing.assert_close(got.detach(), want, atol=tolerance, rtol=10 * tolerance)


def two_peers(make_peer, run_id: str, config: CollaborationConfig) -> tuple[list, list[Optimizer]]:
    """Two models and their optimizers, each knowing of the other."""
    models = [make_model() for _ in range(2)]
    opts = [Optimizer(make_peer(), run_id=run_id, params=m.parameters(), optimizer=adam, config=config)
            for m in models]
    assert all(o.wait_for_peers(2, timeout=10) for o in opts)
    return models, opts


def test_a_peer_waiting_for_its_round_reports_that_it_computes_nothing(make_peer):
    # while a peer waits for its round it takes no batches: its report holds the round's samples
    # at no throughput, so the others add exactly those samples and do not extrapolate more by
    # its past throughput (they would start their next round short of the target)
    models, opts = two_peers(make_peer, "idle", SYNC)
    x, y = make_data()
    outcomes: list = []

    def first_peer() -> None:
        for i in range(TARGET // BATCH):  # its own samples reach the target: the last step waits in its round
            loss_on(models[0], x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]).backward()
            outcomes.append(opts[0].step(BATCH))
            opts[0].zero_grad()

    thread = threading.Thread(target=first_peer)
    thread.start()
    try:
        assert opts[1].tracker.wait_for(lambda p: p.samples == TARGET and p.samples_per_second == 0.0, timeout=10)
    finally:
        # the second peer joins the round, which lets the first one's step return
        loss_on(models[1], x[:BATCH], y[:BATCH]).backward()
        joined = opts[1].step(BATCH)
        thread.join(30)
    assert not thread.is_alive()
    assert joined.round is not None and joined.round.ok and outcomes[-1].round is not None
    assert outcomes[-1].round.ok and opts[0].epoch == opts[1].epoch == 1
    # back to computing, it reports its throughput again
    assert opts[0].tracker.local.samples_per_second > 0


def test_a_waiting_trainer_near_the_target_waits_for_it_instead_of_computing_another_batch(make_peer):
    # rounds waited for, target 38, batches of 16: after one batch each the swarm holds 32; the
    # second peer's batches take 16 s (its throughput, 1 sample/s), so the 6 samples missing are
    # due within half of its next batch: it waits (reporting that it computes nothing) instead of
    # computing a batch the round would then wait for, and joins the round the first peer starts
    # once its own second batch brings the target
    models, opts = two_peers(make_peer, "near", replace(SYNC, target_batch_size=38))
    x, y = make_data()
    loss_on(models[0], x[:BATCH], y[:BATCH]).backward()
    assert opts[0].step(BATCH).round is None  # 16 of 38; its throughput is not known yet (0)
    opts[0].zero_grad()
    assert opts[1].tracker.wait_for(lambda p: p.samples == BATCH, timeout=10)  # the second peer knows it
    opts[1]._meter.rate = 1.0  # a trainer whose batch of 16 takes 16 s
    outcomes: list = []

    def second_peer() -> None:
        loss_on(models[1], x[BATCH:2 * BATCH], y[BATCH:2 * BATCH]).backward()
        outcomes.append(opts[1].step(BATCH))

    thread = threading.Thread(target=second_peer)
    thread.start()
    try:
        # its report while it waits: its 16 samples at no throughput (the first peer's is 0 too)
        assert opts[0].tracker.wait_for(lambda p: p.samples == 32 and p.samples_per_second == 0.0, timeout=10)
    finally:
        loss_on(models[0], x[2 * BATCH:3 * BATCH], y[2 * BATCH:3 * BATCH]).backward()
        first = opts[0].step(BATCH)  # 48 >= 38: it starts the round, which the waiting peer joins
        thread.join(30)
    assert not thread.is_alive() and outcomes
    second = outcomes[0]
    assert first.round is not None and first.round.ok and first.round.samples == 32
    assert second.round is not None and second.round.ok and second.round.samples == BATCH, second
    assert opts[0].epoch == opts[1].epoch == 1
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    assert opts[1].idle_seconds > 0


def train_overlapped(opt: Optimizer, model: torch.nn.Module, data, seed: int, epochs: int, record: dict) -> None:
    """Trains with rounds in flight, recording which parameters (epoch) each batch was computed on
    and which round's window it went into."""
    x, y = data
    g = torch.Generator().manual_seed(seed)
    open_window: list[tuple[int, list[int]]] = []
    launched: list[list[tuple[int, list[int]]]] = []  # windows of the rounds in flight, oldest first
    windows, params, outcomes = record.setdefault("windows", {}), record.setdefault("params", {}), []
    params[0] = [p.detach().clone() for p in opt.shared_tensors]
    while opt.epoch < epochs:
        idx = torch.randint(0, DATA_SIZE, (BATCH,), generator=g)
        version = opt.epoch  # parameters change only inside step()
        loss_on(model, x[idx], y[idx]).backward()
        out = opt.step(BATCH)
        opt.zero_grad()
        assert not out.state_loaded, out
        open_window.append((version, idx.tolist()))
        if out.round is not None:
            outcomes.append(out.round)
            if out.launched is None and out.round.group_size == 1:
                raise AssertionError(f"a peer stepped alone: {out.round}")
            window = launched.pop(0)
            if out.round.ok:
                windows[out.round.epoch] = window
                # (with a round in flight again, the model holds a trial step: not shared)
                params[out.round.epoch + 1] = [p.detach().clone() for p in opt.shared_tensors]
            else:
                open_window = window + open_window  # a failed round's batches are sent again
        if out.launched is not None:
            launched.append(open_window)
            open_window = []
            assert len(launched) == 1, "more than one round in flight"
    record["outcomes"] = outcomes


@pytest.mark.parametrize("num_peers,trial", [(2, False), (3, False), (3, True)])
def test_overlapped_rounds_land_one_step_late_and_keep_peers_identical(make_peer, num_peers, trial):
    # max_staleness 1: each round averages while its peers compute the next batches; its step
    # lands when the average arrives. Every peer holds the same parameters at every epoch, no step
    # applies gradients more than one epoch old, and without trial steps the result is exactly one
    # process taking the same delayed steps (with them, each batch's gradient is computed at its
    # peer's own trial of the step in flight: tests/optim/test_overlap_parts.py checks that part).
    data = make_data()
    epochs = 6
    models = [make_model() for _ in range(num_peers)]
    opts = [Optimizer(make_peer(), run_id="dpu", params=m.parameters(), optimizer=adam,
                      config=replace(FAST, trial_step=trial)) for m in models]
    assert all(o.config.max_staleness == 1 for o in opts)  # the default
    assert all(o.wait_for_peers(num_peers, timeout=10) for o in opts)
    records: list[dict] = [{} for _ in range(num_peers)]
    threads = [threading.Thread(target=train_overlapped, args=(o, m, data, 200 + i, epochs, r))
               for i, (o, m, r) in enumerate(zip(opts, models, records))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for epoch in range(1, epochs + 1):
        first = records[0]["params"][epoch]
        for r in records[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first, r["params"][epoch])), f"peers differ at {epoch}"
    observed = set()
    for r in records:
        for outcome in r["outcomes"]:
            if not outcome.ok:
                continue
            oldest = min(version for version, _ in r["windows"][outcome.epoch])
            assert outcome.staleness == outcome.epoch - oldest, outcome  # the optimizer states it truly
            assert outcome.staleness <= 1, outcome  # the bound
            observed.add(outcome.staleness)
    assert 1 in observed, "no round overlapped the trainers' compute"
    if trial:
        return
    windows = [[b for r in records for b in r["windows"][e]] for e in range(epochs)]
    expected = replay_delayed(windows, data)
    # a round that averaged without a late member's gradients (adaptive deadlines, under load) holds
    # fewer samples than the windows say: the replay is exact up to the first such round's step
    partial = min((o.epoch for r in records for o in r["outcomes"] if o.ok and o.contributors < o.group_size),
                  default=epochs)
    for epoch in range(1, partial + 1):
        for got, want in zip(records[0]["params"][epoch], expected[epoch]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_failed_round_is_retried_by_every_member(make_peer):
    data = make_data()
    models = [make_model() for _ in range(2)]
    peers = [make_peer() for _ in range(2)]

    def faulty_averager(peer):
        # the leader (whichever peer it is) fails before deciding in the first round: the round
        # fails for every member
        plan = FaultPlan().add(FaultPoint.BEFORE_DECISION, Action.RAISE, rounds={0})
        return lambda tensors, prefix: SwarmAverager(
            Averager(peer, tensors, prefix=prefix, target_group_size=2, faults=plan), 4.0)

    opts = [Optimizer(p, run_id="retry", params=m.parameters(), optimizer=adam, config=SYNC,
                      averager_factory=faulty_averager(p)) for p, m in zip(peers, models)]
    assert all(o.wait_for_peers(2, timeout=10) for o in opts)
    records: list[dict] = [{}, {}]
    threads = [threading.Thread(target=train, args=(o, m, data, 7 + i, 3, r))
               for i, (o, m, r) in enumerate(zip(opts, models, records))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    failed = [[h for h in o.history if not h.ok] for o in opts]
    assert all(len(f) == 1 and f[0].epoch == 0 for f in failed), failed
    assert failed[0][0].error == failed[1][0].error
    # the failed round's samples were kept: the first epoch holds more than the target, and the
    # result still equals one process that saw exactly those samples
    epoch_samples = [list(itertools.chain.from_iterable(r["epochs"][e] for r in records)) for e in range(3)]
    assert len(epoch_samples[0]) > TARGET
    expected = reference_params(epoch_samples, data)
    for model in models:
        for got, want in zip(model.parameters(), expected):
            torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=1e-4)


def test_late_joiner_downloads_state_and_continues_from_the_same_epoch(make_peer):
    data = make_data()
    sched = lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
    first = make_model()
    opt_a = Optimizer(make_peer(), run_id="late", params=first.parameters(), optimizer=adam, scheduler=sched,
                      config=FAST)
    record_a: dict = {}
    train(opt_a, first, data, 1, 3, record_a)
    assert opt_a.epoch == 3

    late = make_model(seed=123)  # different initial parameters: they must be replaced
    opt_b = Optimizer(make_peer(), run_id="late", params=late.parameters(), optimizer=adam, scheduler=sched,
                      config=FAST)
    assert opt_b.epoch == 3
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), late.parameters()))
    assert opt_b.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.9**3)
    state_a, state_b = opt_a.optimizer.state_dict()["state"], opt_b.optimizer.state_dict()["state"]
    assert all(torch.equal(state_a[i]["exp_avg_sq"], state_b[i]["exp_avg_sq"]) for i in state_a)

    # both continue together, identical
    assert opt_a.wait_for_peers(2, timeout=10) and opt_b.wait_for_peers(2, timeout=10)
    records: list[dict] = [{}, {}]
    threads = [threading.Thread(target=train, args=(o, m, data, 50 + i, 5, r))
               for i, (o, m, r) in enumerate(zip((opt_a, opt_b), (first, late), records))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert opt_a.epoch == opt_b.epoch == 5
    assert all(torch.equal(a, b) for a, b in zip(opt_a.shared_tensors, opt_b.shared_tensors))


class _Seen(logging.Handler):
    """Sets `event` when a record holding `text` is logged (from any thread)."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text, self.event = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


def test_a_state_asked_for_while_a_round_is_in_flight_is_served_once_the_round_lands(make_peer):
    # rounds overlapped: a state taken while the round is in flight is one epoch behind once the round
    # lands, and the peer that downloads it finds the swarm ahead again (it would download again, and
    # again while each download takes longer than a round); the server waits for the round to land
    models, opts = two_peers(make_peer, "serve", FAST)
    x, y = make_data()

    def until_launched(i: int) -> None:
        for k in range(8):  # each launches round 0 after a few batches (target 64, batches of 16)
            loss_on(models[i], x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH]).backward()
            opts[i].step(BATCH)
            opts[i].zero_grad()
            if opts[i]._in_flight is not None:
                return

    threads = [threading.Thread(target=until_launched, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert opts[0]._in_flight is not None and opts[0].epoch == 0  # its round 0 averages; nothing landed

    seen = _Seen("state asked for while round 0 is in flight")
    logger = logging.getLogger("swarm.optim.optimizer")
    level = logger.level
    logger.addHandler(seen)
    logger.setLevel(logging.DEBUG)
    downloaded: list = []
    newcomer = make_peer()
    download = threading.Thread(target=lambda: downloaded.append(
        load_state_from_peers(newcomer, "serve", [opts[0].peer.addrs[0]], timeout=20)))
    try:
        download.start()
        assert seen.event.wait(20)  # the request reached the first peer while its round is in flight
        # the trainer lands round 0 (waiting for its averaging to end), and only then is the state served
        landed = opts[0].flush()
        download.join(30)
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
    assert landed is not None and landed.ok and opts[0].epoch == 1
    state = TrainingState.from_wire(downloaded[0].tensors, downloaded[0].metadata)
    assert state.epoch == 1
    assert all(torch.equal(a, b) for a, b in zip(state.params, opts[0].shared_tensors))


def test_peer_steps_alone_at_once_when_the_others_leave_during_its_round(make_peer, caplog):
    caplog.set_level(logging.INFO, logger="swarm.optim")
    slow = CollaborationConfig(target_batch_size=32, report_period=0.05, min_refresh_period=0.02,
                               max_refresh_period=0.2, averaging_timeout=60.0)
    model_a, model_b = make_model(), make_model()
    opt_a = Optimizer(make_peer(), run_id="leave", params=model_a.parameters(), optimizer=adam, config=slow)
    opt_b = Optimizer(make_peer(), run_id="leave", params=model_b.parameters(), optimizer=adam, config=slow)
    assert opt_a.wait_for_peers(2, timeout=10)
    x, y = make_data()
    result: dict = {}

    def train_a() -> None:
        while opt_a.epoch == 0:
            loss_on(model_a, x[:16], y[:16]).backward()
            result["out"] = opt_a.step(16)
            opt_a.zero_grad()

    thread = threading.Thread(target=train_a)
    thread.start()
    # A holds the whole target batch and waits in a round for B, which never averages and leaves
    assert opt_a.tracker.wait_for(lambda p: p.ready, timeout=10)
    opt_b.shutdown()
    thread.join(20)
    assert not thread.is_alive()
    round_ = opt_a.history[0]
    assert round_.ok and round_.group_size == 1 and round_.seconds < 20, round_
    assert opt_a.epoch >= 1  # with the round in flight, the batches computed meanwhile may step alone next
    assert "the other peers left during the round" in caplog.text


def test_peer_looking_for_a_group_stops_when_the_swarm_moves_past_its_epoch(make_peer):
    # A peer steps without B (it did not see B yet, or restored a later checkpoint) while B looks
    # for a group at the old epoch, a group that can never form. B must notice from the progress
    # records, stop looking long before its averaging timeout and download the swarm's state.
    slow = replace(FAST, target_batch_size=32, averaging_timeout=60.0)
    model_a, model_b = make_model(seed=1), make_model(seed=2)
    opt_a = Optimizer(make_peer(), run_id="jump", params=model_a.parameters(), optimizer=adam, config=slow)
    opt_b = Optimizer(make_peer(), run_id="jump", params=model_b.parameters(), optimizer=adam, config=slow)
    assert opt_a.wait_for_peers(2, timeout=10) and opt_b.wait_for_peers(2, timeout=10)
    x, y = make_data()
    result: dict = {"calls": 0}

    def train_b() -> None:
        while "out" not in result or result["out"].round is None:
            loss_on(model_b, x[:16], y[:16]).backward()
            result["out"] = opt_b.step(16)
            result["calls"] += 1
            opt_b.zero_grad()

    thread = threading.Thread(target=train_b)
    thread.start()
    try:
        # B holds the whole target batch and has declared itself for the group of epoch 0
        deadline = time.monotonic() + 20
        while not _declared(opt_a.peer, "jump.grads.group.0", opt_b.peer.peer_id):
            assert time.monotonic() < deadline, "B never looked for a group"
        later = opt_a.state_dict()
        later["metadata"]["epoch"] = 3
        opt_a.load_state_dict(later)  # A is at epoch 3 now (a checkpoint restore)
        thread.join(20)
        assert not thread.is_alive()
    finally:
        thread.join(60)
    out = result["out"]
    assert not out.round.ok and "the swarm moved on to epoch 3" in out.round.error, out
    assert out.round.seconds < 20, out  # not the 60 s averaging timeout
    # B never stepped: every sample it took in is dropped (the round's 32, and with the round in
    # flight, the batches computed while it looked for a group)
    assert out.state_loaded and opt_b.epoch == 3 and out.discarded_samples == 16 * result["calls"], out
    assert out.round.samples == 32
    assert all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))
    assert opt_b.failed_rounds == 0  # moving on is not a fault: no re-synchronization countdown


def _declared(peer, key: str, peer_id: str) -> bool:
    found = peer.dht.get(key, latest=True)
    item = found.value.get(owner_marker(peer_id)) if found is not None and isinstance(found.value, dict) else None
    return item is not None and isinstance(item.value, dict) and not item.value.get("done")


def test_peers_holding_different_states_at_one_epoch_converge_on_one(make_peer):
    # two peers that never synchronized (as two groups that stepped apart would be) hold different
    # parameters under the same epoch number: the one whose fingerprint loses re-downloads
    config = replace(FAST, load_state_on_start=False, target_batch_size=10_000)
    models = [make_model(seed=1), make_model(seed=2)]
    opts = [Optimizer(make_peer(), run_id="heal", params=m.parameters(), optimizer=adam, config=config)
            for m in models]
    assert all(o.wait_for_peers(2, timeout=10) for o in opts)
    assert not all(torch.equal(a, b) for a, b in zip(*(m.parameters() for m in models)))
    x, y = make_data()
    outcomes = []
    for opt, model in zip(opts, models):
        loss_on(model, x[:16], y[:16]).backward()
        outcomes.append(opt.step(16))
        opt.zero_grad()
    assert sum(o.state_loaded for o in outcomes) == 1, outcomes
    assert all(torch.equal(a, b) for a, b in zip(*(m.parameters() for m in models)))


def test_a_failed_or_partial_read_of_progress_does_not_make_a_peer_think_it_is_alone(make_peer):
    # A DHT read that times out, or a lookup that misses a record, is no news: a peer that took it
    # for "everyone left" would step alone and leave the swarm's state.
    config = replace(FAST, target_batch_size=10_000)
    a_peer, b_peer = make_peer(), make_peer()
    opt_a = Optimizer(a_peer, run_id="news", params=make_model().parameters(), optimizer=adam, config=config)
    opt_b = Optimizer(b_peer, run_id="news", params=make_model().parameters(), optimizer=adam, config=config)
    assert opt_a.wait_for_peers(2, timeout=10) and opt_b.wait_for_peers(2, timeout=10)
    real_aget = a_peer.dht.aget
    mode = {"now": "fail"}
    reads = threading.Semaphore(0)

    async def faulty_aget(key, latest=False):
        try:
            if mode["now"] == "fail":
                raise TimeoutError("injected: the read timed out")
            found = await real_aget(key, latest=latest)
            if found is not None and isinstance(found.value, dict):  # the lookup missed B's record
                found.value.pop(b_peer.peer_id, None)
            return found
        finally:
            reads.release()

    a_peer.dht.aget = faulty_aget
    for now in ("fail", "miss"):
        mode["now"] = now
        for _ in range(3):  # a few reads of each kind
            opt_a.tracker.request_refresh()
            assert reads.acquire(timeout=10)
        assert opt_a.progress.num_peers == 2, now
    # B leaves for real: its "left" record is news, and A is alone at once
    a_peer.dht.aget = real_aget
    opt_b.shutdown()
    assert opt_a.tracker.wait_for(lambda p: p.num_peers == 1, timeout=10)
