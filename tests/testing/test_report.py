"""The report's figures from a run's events (pure logic, no lab): digests of shared parameters."""

from swarm.testing import report


def digest(t: float, proc: str, epoch: int, sha: str) -> dict:
    return {"t": t, "kind": "digest", "proc": proc, "epoch": epoch, "sha256": sha}


def progress(t: float, proc: str, epoch: int) -> dict:
    return {"t": t, "kind": "progress", "proc": proc, "epoch": epoch}


def test_digests_after_the_last_heal_agree_and_reach_a_common_epoch() -> None:
    events = [
        digest(5, "a", 1, "x"), digest(6, "b", 1, "DIFFERENT"),  # before the heal: not compared
        {"t": 10, "kind": "fault", "id": 1, "fault": "partition b"},
        {"t": 20, "kind": "fault_end", "id": 1, "fault": "partition b"},
        digest(21, "a", 4, "d4"), digest(22, "b", 4, "d4"), digest(23, "a", 5, "d5"),
        progress(24, "a", 5), progress(24, "b", 4),
    ]
    d = report.figures(events)["digests"]
    assert d["after_s"] == 20
    assert d["trainers"] == ["a", "b"]
    assert d["mismatched"] == {} and d["epochs_compared"] == 1
    assert d["common_epoch"] == 4


def test_a_differing_digest_or_a_trainer_that_never_caught_up_is_reported() -> None:
    events = [digest(1, "a", 3, "s"), digest(2, "b", 3, "t"), digest(3, "a", 4, "u"), progress(4, "a", 4),
              progress(4, "b", 3), progress(4, "c", 0)]
    d = report.digest_agreement(events, after=0.0)
    assert d["mismatched"] == {3: {"a": "s", "b": "t"}}
    assert d["common_epoch"] is None  # c trained but never reported a digest


def test_a_swarm_that_stops_stepping_has_stalled_until_its_first_trainer_leaves() -> None:
    events = [progress(t, "a", e) for t, e in ((10, 1), (20, 2), (30, 3), (40, 4), (90, 4), (100, 4))]
    events.append({"t": 80, "kind": "exit", "proc": "a", "code": 0})
    f = report.figures(events)
    assert f["longest_stall_s"] == 40  # from the last step (40 s) to the first trainer's exit (80 s)
    assert f["median_step_s"] == 10
    stepping = [progress(t, "a", e) for t, e in ((10, 1), (20, 2), (30, 3), (40, 4), (45, 4))]
    assert report.figures(stepping)["longest_stall_s"] == 10
