"""The dashboard's picture as plain data (no sockets): what peers report is kept as capped text,
trainers and servers get their roles, hostile reports are dropped or capped, history is bounded."""

from __future__ import annotations

import json

import pytest

from swarm.dashboard.view import (
    DashboardLimits,
    ExpertDeclaration,
    History,
    PeerAnswer,
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
    assert view["experts"]["grids"] == [{"prefix": "ffn.", "rows": [["ffn.0.0", SRV], ["ffn.0.1", SRV]]}]
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
    assert ["ffn.0.0", T1] in rows and all(len(uid) <= 40 for uid, _ in rows)


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
