"""Scenario files: what they may say, and the clear errors for what they may not (no root needed)."""

import pytest

from swarm.testing.scenario import ScenarioError, chaos_faults, parse

BASE = {
    "name": "t", "duration": 30, "link": {"delay_ms": 5},
    "hosts": [{"name": "a"}, {"name": "b", "nat": True, "link": {"up_mbit": 10}}],
    "processes": [{"name": "p", "host": "a", "command": ["{python}", "-c", "pass"]},
                  {"name": "late", "host": "b", "command": ["x"], "start": "manual"}],
}


def with_(**changes):
    return {**BASE, **changes}


def test_links_inherit_the_scenario_link() -> None:
    sc = parse(BASE)
    a, b = sc.hosts
    assert a.link.delay_ms == 5 and b.link.delay_ms == 5 and b.link.up_mbit == 10 and b.nat
    assert sc.processes[1].start is None


@pytest.mark.parametrize(("changes", "message"), [
    ({"duration": -1}, "duration"),
    ({"hosts": []}, r"no \[\[hosts"),
    ({"link": {"delay": 5}}, "unknown link keys"),
    ({"link": {"loss": 2}}, "loss"),
    ({"processes": [{"name": "p", "host": "zz", "command": ["x"]}]}, "no host 'zz'"),
    ({"processes": [{"name": "p", "host": "a", "command": []}]}, "command"),
    ({"faults": [{"at": 1, "kind": "explode", "target": "p"}]}, "kind 'explode'"),
    ({"faults": [{"at": 1, "kind": "kill", "target": "nobody"}]}, "targets must be processes"),
    ({"faults": [{"at": 1, "kind": "partition", "target": "p"}]}, "targets must be hosts"),
    ({"faults": [{"at": 1, "kind": "profile", "target": "a"}]}, "needs a link"),
])
def test_bad_scenarios_are_refused_with_the_reason(changes: dict, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse(with_(**changes))


def test_faults_come_sorted_and_partitions_may_name_sides() -> None:
    sc = parse(with_(faults=[{"at": 9, "kind": "stop", "target": "p", "duration": 2},
                             {"at": 3, "kind": "partition", "sides": [["a"], ["b"]], "duration": 4}]))
    assert [f.at for f in sc.faults] == [3, 9]
    assert sc.faults[0].sides == (("a",), ("b",))


def test_chaos_draws_the_same_faults_for_the_same_seed() -> None:
    chaos = {"start": 10, "end": 100, "every": 20, "seed": 3,
             "menu": [{"kind": "kill_restart", "targets": ["p"]}, {"kind": "stop", "targets": ["p"], "duration": 5}]}
    first, again = chaos_faults(chaos), chaos_faults(chaos)
    assert [f.at for f in first] == [10, 30, 50, 70, 90]
    assert first == again
    assert {f.kind for f in first} <= {"kill_restart", "stop"}
    with pytest.raises(ScenarioError, match="menu"):
        chaos_faults({**chaos, "menu": []})
