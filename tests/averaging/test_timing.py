"""Learned waits and round timeouts (pure logic, no sockets)."""

from __future__ import annotations

import pytest

from swarm.averaging.matchmaking import MatchmakingConfig
from swarm.averaging.timing import ArrivalSpread, RoundTiming, clamp
from swarm.core.errors import ConfigError


def test_wait_bound_starts_at_its_initial_value_and_learns_from_lags():
    spread = ArrivalSpread(initial=5.0, floor=0.05, cap=5.0, margin=1.5, quantile=0.9, window=10)
    assert spread.bound() == 5.0
    for lag in [0.01] * 9 + [0.2]:
        spread.observe(lag)
    # 90th percentile of ten lags is the ninth smallest (0.01): a single straggler does not set it
    assert spread.bound() == pytest.approx(0.05)  # 1.5 * 0.01 is under the floor
    for _ in range(5):
        spread.observe(0.4)
    assert spread.bound(rtt=0.01) == pytest.approx(1.5 * 0.4 + 0.02)
    for _ in range(20):
        spread.observe(100.0)
    assert spread.bound() == 5.0  # the cap: a peer that never comes costs at most this
    assert len(spread.lags) == 10
    spread.observe(float("nan"))
    spread.observe(-3.0)  # early arrivals count as on time
    assert spread.lags[-1] == 0.0


def test_round_timeout_is_a_multiple_of_measured_rounds_and_backs_off_after_failures():
    timing = RoundTiming(multiple=4.0, floor=1.0)
    assert timing.timeout(cap=30.0) == 30.0  # nothing measured: the step's remaining time
    assert timing.timeout(cap=30.0, estimate=2.0) == 8.0  # the links' throughput says 2 s
    for seconds in (0.5, 0.6, 0.5, 0.6, 0.5):
        timing.observe_success(seconds)
    timing.observe_success(2.0)
    assert timing.expected() == pytest.approx(0.6)  # one slow round is not a slower link
    timing.observe_success(2.0)
    assert timing.expected() == 2.0  # two of the last three: the link is slower now
    timing.durations.clear()
    for seconds in (0.5, 3.0, 0.6):
        timing.observe_success(seconds)
    assert timing.timeout(cap=2.0) == 2.0
    timing.observe_failure()
    timing.observe_failure()
    assert timing.timeout(cap=30.0) == pytest.approx(4 * 0.6 * 4)
    timing.observe_success(0.6)
    assert timing.backoff == 1.0
    fast = RoundTiming(multiple=4.0, floor=1.0)
    fast.observe_success(0.01)
    assert fast.timeout(cap=30.0) == 1.0  # the floor
    assert clamp(5.0, floor=2.0, cap=1.0) == 1.0


def test_matchmaking_config_checks_its_waits():
    with pytest.raises(ConfigError):
        MatchmakingConfig(min_wait=2.0, max_wait=1.0)
    with pytest.raises(ConfigError):
        MatchmakingConfig(round_timeout_multiple=0.5)
    with pytest.raises(ConfigError):
        MatchmakingConfig(min_round_timeout=0)
