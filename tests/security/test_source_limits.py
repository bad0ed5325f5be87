"""Many identities from one host: limits per caller (PeerID) cost an attacker nothing to get round,
so the server also names each call's source network (`swarm.net.server.source_of`) and the expert
server limits requests in flight per source (`ExpertServerConfig.max_inflight_per_source`).

The attack runs in a network namespace of its own (`source_limit_scenario.py`), where the attacker
and the honest client can have addresses on different /24s; loopback stays exempt, so local tests
and one-host setups keep their behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest
from netns import run_scenario

from swarm.core.errors import ConfigError, ResourceExhausted
from swarm.moe.server.admission import Admission
from swarm.net.server import ServerConfig, source_of

SCENARIO = Path(__file__).with_name("source_limit_scenario.py")


@pytest.mark.parametrize(
    ("peer", "config", "source"),
    [
        ("ipv4:10.1.2.3:5000", ServerConfig(), "10.1.2.0/24"),
        ("ipv6:[2001:db8::1]:5000", ServerConfig(), "2001:db8::/64"),
        ("ipv6:[::ffff:10.9.8.7]:3", ServerConfig(), "10.9.8.0/24"),  # IPv4 seen through an IPv6 socket
        ("ipv4:127.0.0.1:5", ServerConfig(), ""),  # loopback is exempt by default
        ("ipv6:[::1]:5", ServerConfig(), ""),
        ("ipv4:127.0.0.1:5", ServerConfig(source_exempt=()), "127.0.0.0/24"),
        ("ipv4:10.1.2.3:5000", ServerConfig(source_prefix_v4=32), "10.1.2.3/32"),
        ("unix:/tmp/socket", ServerConfig(), ""),
        ("garbage", ServerConfig(), ""),
    ],
)
def test_source_of_names_the_callers_network(peer: str, config: ServerConfig, source: str) -> None:
    assert source_of(peer, config) == source


def test_bad_source_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="source_exempt"):
        ServerConfig(source_exempt=("not a network",))
    with pytest.raises(ConfigError, match="source_prefix_v4"):
        ServerConfig(source_prefix_v4=33)


def test_admission_holds_one_source_to_its_share_whatever_its_identities() -> None:
    admission = Admission(max_requests=10, max_bytes=1 << 20, max_per_caller=4, max_per_source=6)
    held = []
    for i in range(6):
        held.append(admission.request("forward", f"identity-{i}", "10.0.0.0/24"))
        held[-1].__enter__()
    with pytest.raises(ResourceExhausted, match="per source address"), \
            admission.request("forward", "identity-new", "10.0.0.0/24"):
        pass
    with admission.request("forward", "honest", "10.1.0.0/24"), admission.request("forward", "local", ""):
        assert admission.requests == 8
    for context in held:
        context.__exit__(None, None, None)
    assert admission.by_source == {} and admission.requests == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_many_identities_from_one_network_cannot_lock_out_an_expert_server() -> None:
    result = run_scenario(SCENARIO, timeout=170)
    assert result["honest"] == "ok", result  # served from another /24 while the attack holds its streams
    assert result["by_source"] == {"10.77.0.0/24": 128}, result  # the default max_inflight_per_source
    assert result["all_answered_before_release"], result
    assert result["refused_per_source"] == 5 * 64 - 128 and result["refused_server_full"] == 0, result
