"""The dashboard's picture as plain data (no sockets): what peers report is kept as capped text,
trainers and servers get their roles, hostile reports are dropped or capped, history is bounded."""

from __future__ import annotations

import json

import pytest

from swarm.dashboard.collector import found_runs, uptime, valid_run_id
from swarm.dashboard.view import (
    DashboardLimits,
    ExpertDeclaration,
    GridCache,
    History,
    LinkMeasure,
    PeerAnswer,
    Picture,
    RunReports,
    build_view,
)
from swarm.optim.progress import PeerProgress, RoundSummary

SELF = "12D3KooWSelfSelfSelfSelfSelfSelfSelfSelfSelfSelf"
T1, T2, SRV = "12D3KooWTrainer1aaaaaaaaaaaaa", "12D3KooWTrainer2bbbbbbbbbbbbb", "12D3KooWServerccccccccccccc"


def _view(answers, runs=(), declared=(), limits=None, contributions=None, now=1000.0):
    return build_view(now, SELF, answers, runs, declared, contributions or {}, limits or DashboardLimits())


def test_peers_get_roles_reachability_and_rtt_from_their_answers_and_the_runs():
    answers = [PeerAnswer(SELF, True, role="peer", version="0.2.0", reachability="public", first_seen=900.0),
               PeerAnswer(SRV, True, role="expert-server", experts=("ffn.0.0", "ffn.0.1"), rtt_ms=1.23456),
               PeerAnswer(T1, True, reachability="private", relays=(SRV,), rtt_ms=2.0),
               PeerAnswer("12D3KooWGoneddddddddddd", False)]
    runs = [RunReports("run", (PeerProgress(T1, 3, 10, 5.0, 999.0, loss=2.5, target_batch_size=100,
                                            last_round=RoundSummary(2, True, 2, 1, 0.5)),
                               PeerProgress(T2, 3, 20, 7.0, 999.0, client_mode=True,
                                            last_round=RoundSummary(2, False, 0, 0, 3.0))))]
    view = _view(answers, runs)
    peers = {p["id"]: p for p in view["peers"]}
    assert view["peers"][0]["id"] == SELF and view["peers"][0]["self"] and peers[SELF]["seen_s"] == 100.0
    assert peers[SRV]["roles"] == ["expert server", "relay"] and peers[SRV]["experts"] == 2
    assert peers[SRV]["rtt_ms"] == 1.235
    assert peers[T1]["reachability"] == "relayed" and peers[T1]["roles"] == ["trainer"]
    assert peers[T2]["reachability"] == "client" and peers[T2]["roles"] == ["trainer"]  # known from its report only
    assert peers["12D3KooWGoneddddddddddd"]["reachability"] == "unreachable"
    run = view["runs"][0]
    assert (run["epoch"], run["samples"], run["target"], run["sps"], run["loss"]) == (3, 30, 100, 12.0, 2.5)
    assert [p["id"] for p in run["peers"]] == [T1, T2]
    assert run["last_round"] == {"epoch": 2, "peers": 2, "group_sizes": [0, 2], "failed": 1, "excluded": 1}
    assert run["peers"][0]["round"] == {"epoch": 2, "ok": True, "group": 2, "in_mean": 1, "seconds": 0.5}
    # no load reported: -1 batches, -1 queued, no rate
    assert view["experts"]["grids"] == [{"prefix": "ffn.", "rows": [["ffn.0.0", SRV, -1, -1, None],
                                                                    ["ffn.0.1", SRV, -1, -1, None]]}]
    json.dumps(view, allow_nan=False)  # plain data, no NaN


def test_a_hostile_peer_fills_only_its_own_capped_rows_and_its_strings_stay_text():
    evil = "<img src=x onerror=alert(1)>" * 20
    limits = DashboardLimits(max_text=40, max_experts_per_peer=5, max_experts=8, max_peers=3)
    answers = [PeerAnswer(SELF, True),
               PeerAnswer(SRV, True, role=evil, version=evil, experts=tuple(f"{i}{evil}" for i in range(1000))),
               *(PeerAnswer(f"12D3KooWzExtra{i:015d}", True) for i in range(10))]
    view = _view(answers, limits=limits, declared=[ExpertDeclaration("ffn.0.0", T1)])
    srv = next(p for p in view["peers"] if p["id"] == SRV)
    assert srv["role"].startswith("<img src=x") and len(srv["role"]) == 40 and len(srv["version"]) == 40
    assert len(view["peers"]) == 3 and view["peers_truncated"] and view["peers_total"] == 12
    assert view["experts"]["total"] == 6 and view["experts"]["truncated"]  # the DHT's one, then 5 of its 1000
    rows = [r for g in view["experts"]["grids"] for r in g["rows"]]
    assert ["ffn.0.0", T1, -1, -1, None] in rows and all(len(row[0]) <= 40 for row in rows)


def test_history_keeps_the_last_hours_and_counts_each_peers_samples_of_the_last_hour():
    history = History(seconds=100.0, max_points=50)
    for i in range(200):
        now = 1000.0 + i
        run = {"run_id": "r", "epoch": i // 10, "sps": 10.0, "loss": 3.0 - i / 100,
               "peers": [{"id": T1, "sps": 10.0}] if i < 150 else []}
        history.record({"now": now, "peers": [{"reachability": "public"}], "runs": [run]})
    curves = history.to_json()
    assert len(curves["runs"]["r"]["t"]) == 50 and curves["runs"]["r"]["t"][-1] == 1199.0
    assert curves["peers"]["count"][-1] == 1.0
    assert history.contributions()["r"][T1] == pytest.approx(1490.0)  # 149 intervals of 1 s at 10/s


def test_limits_and_history_refuse_nonsense():
    with pytest.raises(ValueError):
        DashboardLimits(max_text=0)
    with pytest.raises(ValueError):
        History(seconds=0)


def test_peers_show_what_they_say_of_themselves_and_what_the_others_measured_of_them():
    links_to_srv = [LinkMeasure(SRV, rtt, 2e6) for rtt in (10.0, 12.0)]
    answers = [PeerAnswer(SELF, True, uptime_s=50.0, links=(links_to_srv[0],)),
               PeerAnswer(SRV, True, experts=("ffn.0",), uptime_s=7200.4, forward_ms=3.456,
                          links=(LinkMeasure(SRV, 0.001, 9e9),)),  # its own link to itself does not count
               PeerAnswer(T1, True, runs=("r1",), links=(links_to_srv[1],), rejected=((SRV, 3),)),
               PeerAnswer(T2, True, links=(LinkMeasure(SRV, 5000.0, None),), rejected=((SRV, 2), (T1, 1)))]
    view = _view(answers)
    peers = {p["id"]: p for p in view["peers"]}
    srv = peers[SRV]
    assert (srv["uptime_s"], srv["forward_ms"], srv["rejected_answers"]) == (7200.0, 3.46, 5)
    # the lower median of 10, 12 and a liar's 5000 ms; throughput of those that measured one
    assert (srv["link_rtt_ms"], srv["link_mbps"], srv["link_reporters"]) == (12.0, 2.0, 3)
    assert peers[T1]["roles"] == ["trainer"] and peers[T1]["runs"] == ["r1"]  # a run named in its answer
    assert peers[T2]["link_rtt_ms"] is None and peers[T2]["uptime_s"] is None
    assert view["rejections"] == [
        {"client": T1, "client_short": "…aaaaaaaa", "server": SRV, "server_short": "…cccccccc", "count": 3},
        {"client": T2, "client_short": "…bbbbbbbb", "server": SRV, "server_short": "…cccccccc", "count": 2},
        {"client": T2, "client_short": "…bbbbbbbb", "server": T1, "server_short": "…aaaaaaaa", "count": 1}]
    assert len(_view(answers, limits=DashboardLimits(max_rejections=2))["rejections"]) == 2
    json.dumps(view, allow_nan=False)


def test_the_grid_shows_each_experts_load_from_its_own_server_and_its_rate_between_grids():
    cache = GridCache()
    declared = [ExpertDeclaration("ffn.0", SRV), ExpertDeclaration("ffn.1", SRV)]

    def answers(batches: int) -> list[PeerAnswer]:
        return [PeerAnswer(SRV, True, expert_load=(("ffn.0", batches, 2),)),
                PeerAnswer(T1, True, expert_load=(("ffn.1", 10**6, 99),))]  # not its expert: not taken

    first = cache.get(1, declared, answers(10), DashboardLimits(), now=100.0)
    assert first.json["grids"][0]["rows"] == [["ffn.0", SRV, 10, 2, None], ["ffn.1", SRV, -1, -1, None]]
    assert cache.get(1, declared, answers(30), DashboardLimits(), now=102.0) is first  # kept until the next read
    second = cache.get(2, declared, answers(30), DashboardLimits(), now=110.0)
    assert second.json["grids"][0]["rows"][0] == ["ffn.0", SRV, 30, 2, 2.0]  # 20 batches in 10 s


def test_runs_are_found_in_the_peers_answers_live_ones_first_and_one_peer_cannot_crowd_them_out():
    limits = DashboardLimits(max_runs=3, max_runs_per_peer=4)
    liar = PeerAnswer("12D3KooWLiar", True, runs=tuple(f"fake{i}" for i in range(100)))
    honest = [PeerAnswer(T1, True, runs=("quiet", "real")), PeerAnswer(T2, True, runs=("real",))]
    live = [RunReports("quiet", (PeerProgress(T1, 1, 1, 1.0, 999.0),))]
    assert found_runs([liar, *honest], live, limits) == ["quiet", "real", "fake0"]
    assert found_runs([liar], [], limits) == ["fake0", "fake1", "fake2"]  # four taken from it, three shown
    assert valid_run_id("my-run", 96) and not valid_run_id("two words", 96) and not valid_run_id("", 96)
    assert not valid_run_id("x" * 97, 96) and not valid_run_id("bell\a", 96)
    assert uptime(100.0, 160.0) == 60.0
    assert uptime(0.0, 160.0) is None and uptime(200.0, 160.0) is None and uptime(float("nan"), 1.0) is None


def test_each_run_keeps_its_recent_averaging_rounds():
    picture = Picture(DashboardLimits())
    for epoch, ok in ((1, True), (1, True), (2, False), (3, True)):
        reports = (PeerProgress(T1, epoch + 1, 0, 1.0, 999.0, last_round=RoundSummary(epoch, ok, 3, 2, 0.5)),)
        view = picture.snapshot(1000.0 + epoch, SELF, [PeerAnswer(SELF, True)], [RunReports("r", reports)], [], 0)
    assert [(r["epoch"], r["failed"], r["excluded"], r["group_sizes"]) for r in view["runs"][0]["rounds"]] == [
        (3, 0, 1, [3]), (2, 1, 0, [3]), (1, 0, 1, [3])]
