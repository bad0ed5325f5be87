"""Partitioning, flat views and the agreement rule: pure logic, no sockets."""

from __future__ import annotations

import pytest
import torch

from swarm.averaging.agreement import Decision, Report, decide
from swarm.averaging.group import GroupInfo, MemberInfo
from swarm.averaging.partition import FlatTensors, chunk_bounds, part_sizes, schema_digest
from swarm.core.errors import ConfigError


def test_part_sizes_follow_bandwidth_and_add_up():
    assert part_sizes(10, [1, 1]) == [5, 5]
    assert part_sizes(100, [1, 3]) == [25, 75]
    assert part_sizes(7, [1, 1, 1]) == [3, 2, 2]  # remainder goes to the earliest of equal remainders
    assert part_sizes(10, [0, 1]) == [0, 10]  # a zero-bandwidth reducer gets an empty part
    assert part_sizes(9, [0, 0, 0]) == [3, 3, 3]
    for n in (0, 1, 17, 1_000_003):
        assert sum(part_sizes(n, [0.3, 2.5, 1.1, 0.0])) == n
    with pytest.raises(ValueError):
        part_sizes(10, [-1, 1])


def test_chunk_bounds_cover_the_part():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(0, 4) == []


def test_flat_tensors_read_and_write_across_tensors_and_dtypes():
    a, b, c = torch.arange(6.0).view(2, 3), torch.arange(6.0, 10.0).half(), torch.arange(10.0, 12.0).double()
    flat = FlatTensors([a, b, c])
    assert flat.numel == 12
    flat.refresh()
    assert flat.read(4, 9).tolist() == [4, 5, 6, 7, 8]  # spans a float32 and a staged float16 tensor
    assert flat.read(1, 3).data_ptr() == a.view(-1)[1:3].data_ptr()  # contiguous float32: no copy
    flat.write(5, torch.full((6,), -1.0))
    flat.commit()
    assert a.view(-1).tolist() == [0, 1, 2, 3, 4, -1]
    assert b.tolist() == [-1, -1, -1, -1] and c.tolist() == [-1, 11]
    with pytest.raises(TypeError):
        FlatTensors([torch.arange(3)])


def test_schema_digest_tells_shapes_apart():
    assert schema_digest([torch.zeros(2, 3)]) == schema_digest([torch.ones(2, 3)])
    assert schema_digest([torch.zeros(2, 3)]) != schema_digest([torch.zeros(3, 2)])


def _group(n: int, clients: tuple[int, ...] = (), aux: tuple[int, ...] = ()) -> GroupInfo:
    members = tuple(
        MemberInfo(f"p{i}", "" if i in clients else f"/ip4/127.0.0.1/tcp/{1000 + i}", weight=0.0 if i in aux else i + 1.0,
                   client_mode=i in clients, auxiliary=i in aux)
        for i in range(n)
    )
    return GroupInfo(b"r1", "run", members, numel=100, timeout=5.0)


def test_group_roles():
    g = _group(4, clients=(2,), aux=(3,))
    assert g.reducers == [0, 1, 3] and g.senders == [0, 1, 2]
    assert g.part_of(2) is None and g.part_of(3) == 2
    assert GroupInfo.from_proto(g.to_proto()) == g
    with pytest.raises(ConfigError):
        GroupInfo(b"r", "run", (MemberInfo("c", client_mode=True), MemberInfo("s", "/ip4/1.2.3.4/tcp/1")), 1, 1.0)
    with pytest.raises(ConfigError):
        MemberInfo("x", "/ip4/1.2.3.4/tcp/1", weight=1.0, auxiliary=True)


def test_decision_is_the_intersection_of_reports():
    g = _group(4, clients=(3,))  # reducers 0, 1, 2; senders 0..3
    reports = {
        0: Report(0, frozenset({0, 1, 2, 3})),
        1: Report(1, frozenset({0, 1, 3}), {2: "stalled"}),
        2: Report(2, frozenset({0, 1, 2}), {3: "non-finite values"}),
    }
    d = decide(g, reports)
    assert not d.abort and d.contributors == (0, 1) and d.weights == (1.0, 2.0)
    assert d.excluded == {2: "stalled", 3: "non-finite values"}
    assert Decision.from_bytes(d.to_bytes()) == d


def test_decision_aborts_without_a_report_or_without_contributors():
    g = _group(3)
    d = decide(g, {0: Report(0, frozenset({0, 1, 2})), 2: Report(2, frozenset({0, 1, 2}))})
    assert d.abort and "did not report" in d.reason
    nothing = {p: Report(p, frozenset()) for p in range(3)}
    assert decide(g, nothing).abort
