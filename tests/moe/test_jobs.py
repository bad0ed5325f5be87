"""Planning a mixture batch's calls: one job per expert, one group call per server (no sockets)."""

from __future__ import annotations

import torch

from swarm.moe.client.beam_search import ExpertChoice
from swarm.moe.client.jobs import ExpertJob, plan_jobs, plan_shares


def job(uid: str, addr: str, rows: list[int]) -> ExpertJob:
    return ExpertJob(uid, addr, torch.tensor(rows), torch.zeros(len(rows), dtype=torch.long), None)


def test_jobs_group_each_experts_samples_and_slots() -> None:
    codes = torch.tensor([[0, 1], [1, 2], [2, 0]])
    valid = torch.tensor([[True, True], [True, False], [True, True]])
    choice = ExpertChoice(codes, valid, {0: ("e.0", "A"), 1: ("e.1", "A"), 2: ("e.2", "B")}, (3,))
    jobs = plan_jobs(choice, keep_graphs=True)
    assert [(j.uid, j.rows.tolist(), j.slots.tolist()) for j in jobs] == [
        ("e.0", [0, 2], [0, 1]), ("e.1", [0, 1], [1, 0]), ("e.2", [2], [0])  # (1, slot 1) is not valid
    ]
    assert all(j.graph_id is not None for j in jobs)
    assert all(j.graph_id is None for j in plan_jobs(choice, keep_graphs=False))


def test_a_server_whose_experts_take_every_row_gets_no_indices() -> None:
    shares = plan_shares([job("e.0", "A", [0, 1, 2]), job("e.1", "A", [0, 1, 2])], batch=3)
    assert len(shares) == 1
    assert shares[0].jobs == (0, 1) and shares[0].rows is None and shares[0].member_rows == (None, None)


def test_shares_send_the_union_of_rows_once_and_index_into_it() -> None:
    jobs = [job("e.0", "A", [1, 4]), job("e.1", "B", [0, 1, 2, 3, 4]), job("e.2", "A", [2, 4]),
            job("e.3", "B", [3])]
    a, b = plan_shares(jobs, batch=5)
    assert a.addr == "A" and a.jobs == (0, 2)
    assert a.rows.tolist() == [1, 2, 4]
    assert [r.tolist() for r in a.member_rows] == [[0, 2], [1, 2]]
    assert b.addr == "B" and b.jobs == (1, 3) and b.rows is None  # e.1 needs every row
    assert b.member_rows[0] is None and b.member_rows[1].tolist() == [3]


def test_a_union_covering_the_batch_is_sent_whole() -> None:
    (share,) = plan_shares([job("e.0", "A", [0, 2]), job("e.1", "A", [1])], batch=3)
    assert share.rows is None
    assert [r.tolist() for r in share.member_rows] == [[0, 2], [1]]
