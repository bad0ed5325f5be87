"""Tests of swarm.moe.server.saved_graphs: bounded by rows, by age and by the expert's version."""

from __future__ import annotations

import time

import pytest
import torch

from swarm.moe.server.saved_graphs import SavedForward, SavedGraphs


def saved(rows: int, version: int = 0, created: float | None = None, value: float = 1.0) -> SavedForward:
    x = torch.full((rows, 2), value)
    return SavedForward((x,), (x * 2,), version, rows, time.monotonic() if created is None else created)


def test_put_pop_and_row_budget_evicts_oldest_first() -> None:
    graphs = SavedGraphs(max_rows=10, ttl=60)
    graphs.put("a", saved(4))
    graphs.put("b", saved(4))
    graphs.put("c", saved(4))  # 12 rows > 10: "a" goes
    assert len(graphs) == 2 and graphs.rows == 8
    assert graphs.pop("a") is None
    assert graphs.pop("b") is not None and graphs.pop("b") is None
    assert graphs.rows == 4
    assert not graphs.accepts(11) and graphs.accepts(10) and not SavedGraphs(0, 1).accepts(1)


def test_expired_and_outdated_entries_are_dropped() -> None:
    graphs = SavedGraphs(max_rows=100, ttl=5)
    graphs.put("old", saved(2, created=time.monotonic() - 10))
    assert graphs.pop("old") is None and graphs.rows == 0
    graphs.put("v0", saved(2, version=0))
    graphs.put("v1", saved(2, version=1))
    graphs.invalidate_before(1)
    assert graphs.pop("v0") is None and graphs.pop("v1") is not None


def test_matches_requires_same_version_and_inputs() -> None:
    entry = saved(3, version=2, value=1.5)
    same = torch.full((3, 2), 1.5)
    assert entry.matches([same], 2)
    assert not entry.matches([same], 3)
    assert not entry.matches([same + 1], 2)
    assert not entry.matches([torch.full((4, 2), 1.5)], 2)
    assert not entry.matches([same, same], 2)


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        SavedGraphs(-1, 1)
    with pytest.raises(ValueError):
        SavedGraphs(1, 0)
