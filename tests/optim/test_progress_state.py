"""Pure parts of collaborative training, without sockets: progress arithmetic, state, accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.core.errors import ConfigError
from swarm.optim import CollaborationConfig, DiLoCoConfig
from swarm.optim.accumulator import GradientAccumulator
from swarm.optim.progress import PeerProgress, ThroughputMeter, canonical_digest, merge_read, summarize
from swarm.optim.training_state import TrainingState, state_digest


def report(peer: str, epoch: int, samples: int, sps: float = 10.0, time: float = 100.0, digest: str = ""):
    return PeerProgress(peer, epoch, samples, sps, time, digest=digest)


def test_swarm_progress_counts_the_newest_epoch_and_extrapolates_fresh_reports():
    local = report("me", 3, 40, time=100.0)
    others = [report("a", 3, 30, sps=20.0, time=99.0), report("b", 2, 500, time=100.0)]  # b is behind
    p = summarize(others, local, target_batch_size=100, now=100.0, extrapolate_for=5.0)
    assert (p.epoch, p.samples, p.num_peers, p.num_peers_at_epoch) == (3, 70, 3, 2)
    assert p.estimated_samples == pytest.approx(90.0)  # a has processed ~20 more since its report
    assert not p.ready and p.eta == pytest.approx(10 / 40)
    stale = summarize(others, local, 100, now=120.0, extrapolate_for=5.0)  # a's report is too old to trust
    assert stale.estimated_samples == 70
    assert summarize(others, report("me", 3, 75), 100, now=100.0, extrapolate_for=5.0).ready
    assert math.isinf(summarize([], local, None, now=100.0, extrapolate_for=5.0).eta)


def test_records_round_trip_and_hostile_ones_are_dropped():
    r = PeerProgress("p", 4, 17, 3.5, 123.0, True, "/ip4/127.0.0.1/tcp/1/p2p/x", "abcd")
    assert PeerProgress.from_record("p", r.to_record()) == r
    for bad in (None, "x", {"epoch": -1, "samples": 0, "sps": 0, "time": 0}, {"epoch": 1},
                {"epoch": 1, "samples": 2, "sps": float("nan"), "time": 0}, {"left": True}):
        assert PeerProgress.from_record("p", bad) is None


def test_a_waiting_peer_whose_record_a_read_missed_counts_until_its_record_expires():
    """A peer held up (waiting for another, a round, a download) repeats its last report, time
    included, in heartbeats that renew its record. A read that misses it (a new node's empty copy)
    keeps it while the record lives, however old the report's time; it goes once the record
    expires or the peer says it left. The last two runs of the restart test under torchrun failed
    here: the waiting peer's 5-s-old report was dropped, and the restarted job stepped alone."""
    waiting = report("w", 3, 0, time=95.0)  # reported at 95 s, renewed since by heartbeats
    known = {"w": (waiting, 103.0), "x": (report("x", 3, 8, time=100.5), 101.0)}
    fresh = {"me": (report("me", 3, 0, time=100.0), 103.0)}
    merged = merge_read(known, fresh, left=set(), now=100.0)
    assert merged["w"] == (waiting, 103.0)  # missed by this read, counted: its record lives on to 103 s
    assert "x" in merged
    later = merge_read(merged, fresh, left=set(), now=102.0)
    assert "w" in later and "x" not in later  # x's record expired at 101 s
    assert "w" not in merge_read(later, fresh, left=set(), now=103.5)
    assert "w" not in merge_read(known, fresh, left={"w"}, now=100.0)  # it said it left
    # read again: the newer report counts, and the later expiration of the two
    renewed = {"w": (report("w", 3, 0, time=95.0), 106.0)}
    assert merge_read(known, renewed, set(), now=100.0)["w"] == (waiting, 106.0)
    newer = report("w", 4, 16, time=101.0)
    assert merge_read({"w": (newer, 104.0)}, renewed, set(), now=101.5)["w"] == (newer, 106.0)


def test_canonical_digest_is_the_majority_and_ties_break_the_same_way_everywhere():
    same = [report("a", 5, 0, digest="d1"), report("b", 5, 0, digest="d1")]
    assert canonical_digest(same, 5) is None
    split = [*same, report("c", 5, 0, digest="d0"), report("d", 4, 0, digest="zz")]
    assert canonical_digest(split, 5) == "d1"
    assert canonical_digest([report("a", 1, 0, digest="y"), report("b", 1, 0, digest="x")], 1) == "x"


def test_state_round_trips_through_the_wire_form_with_adam_state_and_scheduler():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    state = TrainingState(7, [p.detach() for p in model.parameters()], opt.state_dict(), sched.state_dict())
    tensors, metadata = state.clone().to_wire()
    back = TrainingState.from_wire(tensors, metadata)
    assert back.epoch == 7 and all(torch.equal(a, b) for a, b in zip(back.params, state.params))
    other = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(other.parameters(), lr=0.1)
    opt2.load_state_dict(back.optimizer)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.999)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises((ValueError, TypeError)):
        TrainingState.from_wire(tensors, {"epoch": 1})
    with pytest.raises(ValueError):
        back.check_compatible([torch.zeros(5)])


def test_state_digest_tells_equal_states_from_diverged_ones():
    a = [torch.arange(10.0), torch.ones(3, 3)]
    assert state_digest(a) == state_digest([t.clone() for t in a])
    assert state_digest(a) != state_digest([a[0] + 1e-6, a[1]])


def test_accumulated_mean_equals_the_gradient_of_all_samples():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(10, 4), torch.randn(10, 1)
    acc = GradientAccumulator(list(model.parameters()))
    for rows in (slice(0, 3), slice(3, 10)):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        acc.add(rows.stop - rows.start)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    for mean, p in zip(acc.compute_means(), model.parameters()):
        torch.testing.assert_close(mean, p.grad)
    assert acc.reset() == 10 and acc.samples == 0


def test_throughput_meter_smooths_rates_and_leaves_out_pauses():
    meter = ThroughputMeter(time_constant=1.0)
    meter.update(10, 0.0)
    assert meter.update(10, 1.0) == pytest.approx(10.0)
    meter.resume(99.0)  # 1.0 .. 99.0 was not training (a round waited for)
    assert meter.update(10, 100.0) == pytest.approx(10.0)  # 10 samples in the 1 s since


def test_throughput_meter_follows_a_trainer_that_waits_after_every_batch():
    meter = ThroughputMeter(time_constant=0.5)
    meter.update(10, 0.0)
    assert meter.update(10, 1.0) == pytest.approx(10.0)
    now = 1.0
    for _ in range(20):  # each batch now takes 0.5 s of compute, then 2 s of waiting
        now += 0.5
        meter.update(10, now)
        now += 2.0
        meter.resume(now)
    assert meter.rate == pytest.approx(20.0, rel=0.01)


def test_configs_refuse_nonsense():
    with pytest.raises(ConfigError):
        CollaborationConfig(target_batch_size=0)
    with pytest.raises(ConfigError):
        CollaborationConfig(report_period=5.0, progress_expiration=10.0)
    with pytest.raises(ConfigError):
        DiLoCoConfig(local_steps=0)
    with pytest.raises(ConfigError):
        DiLoCoConfig(outer_momentum=1.0)


def test_a_reported_loss_round_trips_and_a_hostile_one_is_dropped_without_losing_the_report():
    r = PeerProgress("p", 4, 17, 3.5, 123.0, loss=2.25)
    assert PeerProgress.from_record("p", r.to_record()) == r
    assert "loss" not in PeerProgress("p", 4, 17, 3.5, 123.0).to_record()  # older readers see the same record
    for bad_loss in (float("nan"), float("inf")):
        back = PeerProgress.from_record("p", {**r.to_record(), "loss": bad_loss})
        assert back is not None and back.loss is None and back.epoch == 4
    assert PeerProgress.from_record("p", {**r.to_record(), "loss": "high"}) is None


def test_a_reported_round_round_trips_and_a_malformed_one_is_dropped_without_losing_the_report():
    from swarm.optim.progress import RoundSummary

    r = PeerProgress("p", 4, 17, 3.5, 123.0, last_round=RoundSummary(3, True, 4, 3, 0.25))
    assert PeerProgress.from_record("p", r.to_record()) == r
    for bad in ([3, True, 4, 3], [3, "yes", 4, 3, 0.2], [-1, True, 4, 3, 0.2], [3, True, 4, 3, float("nan")], "x"):
        back = PeerProgress.from_record("p", {**r.to_record(), "round": bad})
        assert back is not None and back.last_round is None and back.epoch == 4
