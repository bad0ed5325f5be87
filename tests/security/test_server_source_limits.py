"""Many identities from one network against every service of a peer, not only the expert server:
its DHT node (records stored per source network, Finds per second per source) and its averaging
service (streams in flight per source), all admitted by the server's one limiter
(`swarm.net.limits`). The attack runs in a network namespace of its own
(`server_limit_scenario.py`), where the attacker and the honest peer have addresses on different
/24s; an honest peer is served throughout."""

from __future__ import annotations

from pathlib import Path

import pytest
from netns import run_scenario

SCENARIO = Path(__file__).with_name("server_limit_scenario.py")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_many_identities_from_one_network_are_held_to_one_share_of_the_dht_and_the_averager() -> None:
    result = run_scenario(SCENARIO, timeout=230)
    # 5 identities x 10 stores from one /24: the network's 20 records, however many identities
    assert result["sybil_stored"] == 20 and result["sybil_refused_per_source"] == 30, result
    assert result["honest_stores"] == ["stored"] * 10, result  # another /24 has its own share
    # 200 Finds at once at 5/s with bursts of 10: most are refused, each saying why
    assert result["flood_refused_rate"] >= 100 and result["flood_found"] + result["flood_refused_rate"] == 200, result
    assert result["honest_finds"] == ["found"] * 3, result
    # 160 stalled Reduce streams: the averaging service's 128 per source network, the rest refused
    assert result["streams_held"] == 128 and result["streams_refused_per_source"] == 32, result
    assert result["honest_join"].startswith("no averager"), result  # served while the streams are held
