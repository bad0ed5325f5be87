"""Sybils: fifty identities from one address cannot fill a victim's routing table nor take every
replica of a key they ground IDs next to, because the table holds few contacts per network prefix
and a store few replicas per prefix (`swarm.dht.diversity`); honest nodes from other networks
still get in. Runs real DHT nodes in a network namespace of its own (`sybil_scenario.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from netns import run_scenario

SCENARIO = Path(__file__).with_name("sybil_scenario.py")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fifty_sybils_from_one_address_neither_fill_the_table_nor_take_every_replica() -> None:
    result = run_scenario(SCENARIO, timeout=230)
    assert result["sybils_in_table"] <= 10 and result["sybils_per_depth"] <= 2, result  # PrefixDiversity defaults
    assert result["honest_in_table"] == 6, result  # every honest node from another /24 got in
    assert result["stored"] and result["sybil_replicas"] <= 2, result  # per_key
    assert result["honest_replicas"] >= 3, result  # the other replicas went to honest networks
