"""The demo trainer's mode: the run's (from the DHT), or the one that fits this peer's link, printed."""

from __future__ import annotations

import threading

import pytest

from swarm.core.errors import ConfigError
from swarm.demo.events import Notice
from swarm.demo.launcher import DemoConfig, run_mode
from swarm.demo.mode import DEFAULT_DILOCO_STEPS, ModeChoice, from_record, is_public, pick_mode
from swarm.demo.trainer import Trainer, TrainerConfig


def test_the_link_picks_the_mode_when_the_run_has_none():
    local = pick_mode("auto", None, None, rtt=0.0004, announce=(), client_mode=False)
    assert local.mode == "large-batch" and "0.4 ms" in local.why
    assert pick_mode("auto", None, None, rtt=None, announce=(), client_mode=False).mode == "large-batch"
    wan = pick_mode("auto", None, None, rtt=0.052, announce=(), client_mode=False)
    assert (wan.mode, wan.local_steps) == ("diloco", DEFAULT_DILOCO_STEPS) and "52 ms" in wan.why
    public = pick_mode("auto", None, None, rtt=None, announce=("/ip4/8.8.8.8/tcp/31337",), client_mode=False)
    assert public.mode == "diloco" and "8.8.8.8" in public.why
    assert pick_mode("auto", None, None, rtt=None, announce=("/ip4/10.0.0.5/tcp/1",), client_mode=False).mode \
        == "large-batch"  # a private address is a local network
    assert pick_mode("auto", None, None, rtt=None, announce=(), client_mode=True).mode == "diloco"
    assert pick_mode("auto", 20, None, rtt=0.0001, announce=(), client_mode=False).local_steps == 20
    assert "mode: large-batch" in local.describe() and "mode: DiLoCo" in wan.describe()


def test_a_large_batch_peer_waits_for_its_rounds_on_a_local_link_and_overlaps_them_across_the_internet():
    local = pick_mode("auto", None, None, rtt=0.0004, announce=(), client_mode=False)
    assert local.max_staleness == 0 and "each round waited for" in local.describe()
    assert pick_mode("auto", None, None, rtt=None, announce=(), client_mode=False).max_staleness == 0
    # the run is large-batch, but this peer joins it over a wide-area link: it overlaps its rounds
    run = ModeChoice("large-batch", None, "").to_record()
    far = pick_mode("auto", None, run, rtt=0.052, announce=(), client_mode=False)
    assert (far.mode, far.max_staleness) == ("large-batch", 1) and "averaged while" in far.describe()
    assert pick_mode("auto", None, run, rtt=None, announce=(), client_mode=True).max_staleness == 1
    assert pick_mode("large-batch", None, None, rtt=0.0001, announce=(), client_mode=False).max_staleness == 0
    assert pick_mode("large-batch", None, None, rtt=0.0001, announce=(), client_mode=False,
                     max_staleness="1").max_staleness == 1
    assert pick_mode("auto", None, run, rtt=0.052, announce=(), client_mode=False,
                     max_staleness="0").max_staleness == 0
    # the staleness is each peer's own: it never enters the run's record
    assert "max_staleness" not in far.to_record()
    with pytest.raises(ConfigError, match="--max-staleness"):
        pick_mode("auto", None, None, rtt=None, announce=(), client_mode=False, max_staleness="2")


def test_the_runs_mode_wins_over_the_link_and_a_bad_record_is_ignored():
    run = {"mode": "diloco", "local_steps": 30}
    adopted = pick_mode("auto", None, run, rtt=0.0001, announce=(), client_mode=False)
    assert (adopted.mode, adopted.local_steps) == ("diloco", 30) and "the run's mode" in adopted.why
    assert pick_mode("large-batch", None, run, rtt=None, announce=(), client_mode=False).mode == "large-batch"
    for bad in ("diloco", {"mode": "diloco"}, {"mode": "diloco", "local_steps": 0}, {"mode": "x"},
                {"mode": "large-batch", "local_steps": 3}):
        assert from_record(bad) is None, bad
    assert from_record(ModeChoice("large-batch", None, "").to_record()).mode == "large-batch"
    with pytest.raises(ConfigError):
        pick_mode("fast", None, None, rtt=None, announce=(), client_mode=False)
    assert not is_public("/dns4/example.com/tcp/1") and is_public("/ip6/2001:4860::8888/tcp/1")


def test_a_trainer_that_joins_follows_the_mode_the_run_started_with():
    first_events: list[object] = []
    first = Trainer(TrainerConfig(name="first", listen="/ip4/127.0.0.1/tcp/0", mode="diloco", diloco_steps=12,
                                  local_experts=True), first_events.append, threading.Event())
    try:
        joined_events: list[object] = []
        joined = Trainer(TrainerConfig(name="joined", listen="/ip4/127.0.0.1/tcp/0",
                                       initial_peers=tuple(first.peer.addrs), local_experts=True),
                         joined_events.append, threading.Event())
        try:
            assert joined.optimizer.mode.name == "diloco" and joined.optimizer.mode.config.local_steps == 12
            said = [e.message for e in joined_events if isinstance(e, Notice) and e.message.startswith("mode: ")]
            assert len(said) == 1 and "DiLoCo, 12 local steps" in said[0] and "the run's mode" in said[0], said
        finally:
            joined.close()
    finally:
        first.close()
    assert any(isinstance(e, Notice) and e.message.startswith("mode: DiLoCo") and "asked for" in e.message
               for e in first_events)


@pytest.mark.parametrize("staleness", ["auto", "0", "1"])
def test_the_demo_states_the_rounds_its_loopback_trainers_will_say_they_run(staleness):
    # the launcher's first line and each trainer's own line (its choice on loopback) agree
    trainer = pick_mode("auto", None, None, rtt=0.0004, announce=(), client_mode=False, max_staleness=staleness)
    header = run_mode(DemoConfig(max_staleness=staleness))
    for phrase in ("each round waited for", "averaged while the next batches compute"):
        assert (phrase in header) == (phrase in trainer.describe()), (header, trainer.describe())
    assert "DiLoCo, 5 local steps" in run_mode(DemoConfig(diloco_steps=5, max_staleness=staleness))
