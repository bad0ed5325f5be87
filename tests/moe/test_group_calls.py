"""Group calls (several experts of one server per stream) against an in-process ExpertServer.

Numbers are checked against the same modules run locally: outputs, summed input gradients and
updated parameters within rtol=1e-5, atol=1e-6.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from swarm.core.errors import InvalidRequest, NotFound, RemoteError, RPCError
from swarm.moe import ExpertServer
from swarm.moe.group_calls import FORWARD_GROUP, GroupMember, call_backward_group, call_forward_group
from swarm.moe.schema import TensorSchema
from swarm.net.streaming import tensors_to_messages

pytestmark = pytest.mark.timeout(60)
TOL = {"rtol": 1e-5, "atol": 1e-6}
HID = 6
UIDS = ("ffn.0", "ffn.1", "ffn.2")


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


class Fragile(nn.Module):
    """A linear expert that raises on inputs holding a value above 100."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HID, HID)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x > 100).any()):
            raise ValueError("input too large")
        return self.lin(x)


@pytest.fixture
def served(make_peer):
    torch.manual_seed(0)
    modules = {uid: nn.Linear(HID, HID) for uid in UIDS}
    modules["frag.0"] = Fragile()
    local = {uid: copy.deepcopy(m) for uid, m in modules.items()}
    server_peer, client = make_peer(), make_peer(client_mode=True)
    server = ExpertServer(server_peer, modules, optimizer_factory=sgd, declare=False,
                          args_schema=[TensorSchema((HID,), torch.float32)])
    return server, client, local


def forward_group(client, server, members, inputs):
    answers: dict[int, object] = {}

    async def go() -> None:
        channel = client.pool.get(server.peer.addrs[0])
        await call_forward_group(channel, members, inputs, answers.__setitem__, timeout=10)

    client.run(go(), timeout=20)
    return answers


def backward_group(client, server, members, inputs, grads):
    errors: dict[int, RPCError] = {}

    async def go():
        channel = client.pool.get(server.peer.addrs[0])
        return await call_backward_group(channel, members, inputs, grads, errors.__setitem__, timeout=10)

    answered, summed = client.run(go(), timeout=20)
    return answered, summed, errors


def test_group_calls_match_each_expert_run_locally(served) -> None:
    server, client, local = served
    x = torch.randn(6, HID)
    shares = [None, torch.tensor([0, 2, 5]), torch.tensor([1, 2])]
    members = [GroupMember(uid, graph_id=100 + i, rows=rows) for i, (uid, rows) in enumerate(zip(UIDS, shares))]
    answers = forward_group(client, server, members, [x])
    assert sorted(answers) == [0, 1, 2]
    for i, (uid, rows) in enumerate(zip(UIDS, shares)):
        torch.testing.assert_close(answers[i][0], local[uid](x if rows is None else x[rows]), **TOL)

    grads = [[torch.randn(6 if rows is None else len(rows), HID)] for rows in shares]
    answered, summed, errors = backward_group(client, server, members, [x], grads)
    assert sorted(answered) == [0, 1, 2] and errors == {}
    x_local = x.clone().requires_grad_()
    for uid, rows, (g,) in zip(UIDS, shares, grads):
        local[uid](x_local if rows is None else x_local[rows]).backward(g)
        opt = sgd(list(local[uid].parameters()))
        opt.step()
    torch.testing.assert_close(summed[0], x_local.grad, **TOL)
    for uid in UIDS:
        for p_remote, p_local in zip(server.backends[uid].module.parameters(), local[uid].parameters()):
            torch.testing.assert_close(p_remote.detach(), p_local.detach(), **TOL)
    stats = server.stats()
    assert stats["admitted"] == 2 and stats["saved_graph_hits"] == 3 and stats["saved_graph_misses"] == 0


def test_a_failing_expert_fails_alone(served) -> None:
    server, client, local = served
    x = torch.randn(4, HID)
    x[3, 0] = 1000.0  # Fragile raises on it, but only when that row is in its share
    members = [GroupMember("ffn.0"), GroupMember("ffn.9"), GroupMember("frag.0"), GroupMember("ffn.1")]
    answers = forward_group(client, server, members, [x])
    assert isinstance(answers[1], NotFound) and "ffn.9" in str(answers[1])
    assert isinstance(answers[2], RemoteError) and "input too large" in str(answers[2])
    torch.testing.assert_close(answers[0][0], local["ffn.0"](x), **TOL)
    torch.testing.assert_close(answers[3][0], local["ffn.1"](x), **TOL)

    before = [p.detach().clone() for p in server.backends["ffn.1"].module.parameters()]
    members = [GroupMember("ffn.0"), GroupMember("ffn.1"), GroupMember("frag.0", rows=torch.tensor([0, 1]))]
    bad = torch.full((4, HID), math.nan)
    grads = [[torch.ones(4, HID)], [bad], [torch.ones(2, HID)]]
    answered, summed, errors = backward_group(client, server, members, [x], grads)
    assert sorted(answered) == [0, 2] and list(errors) == [1]
    assert isinstance(errors[1], InvalidRequest) and "NaN or infinite" in str(errors[1])
    x_local = x.clone().requires_grad_()
    local["ffn.0"](x_local).backward(torch.ones(4, HID))
    local["frag.0"](x_local[:2]).backward(torch.ones(2, HID))
    torch.testing.assert_close(summed[0], x_local.grad, **TOL)
    for p, p_before in zip(server.backends["ffn.1"].module.parameters(), before):
        assert torch.equal(p.detach(), p_before)  # the expert with bad gradients took no step


def raw_group_stream(client, server, tensors, metadata):
    async def go():
        channel = client.pool.get(server.peer.addrs[0])
        return [m async for m in channel.stream(FORWARD_GROUP, tensors_to_messages(tensors, metadata), timeout=10)]

    return client.run(go(), timeout=20)


@pytest.mark.parametrize(
    ("tensors", "metadata", "error", "fragment"),
    [
        ([torch.randn(2, HID)], {"inputs": 1, "experts": [{"uid": "ffn.0"}, {"uid": "ffn.0"}]},
         InvalidRequest, "names an expert twice"),
        ([torch.randn(2, HID)], {"experts": [{"uid": "ffn.0"}]}, InvalidRequest, "group request metadata must be"),
        ([torch.randn(2, HID)], {"inputs": 1, "experts": []}, InvalidRequest, "names 1 to"),
        ([torch.randn(2, HID)], {"inputs": 1, "experts": [{"uid": "nope.1"}]}, NotFound, "none of the 1 experts"),
        ([torch.randn(2, HID)], {"inputs": 1, "experts": [{"uid": "ffn.0", "rows": True}]},
         InvalidRequest, "expected 2 tensors, got 1"),
        ([torch.randn(3, HID), torch.tensor([2, 1])], {"inputs": 1, "experts": [{"uid": "ffn.0", "rows": True}]},
         InvalidRequest, "strictly increasing indices below 3"),
        ([torch.randn(3, HID), torch.tensor([0, 3])], {"inputs": 1, "experts": [{"uid": "ffn.0", "rows": True}]},
         InvalidRequest, "strictly increasing indices below 3"),
        ([torch.randn(3, HID), torch.tensor([0.0])], {"inputs": 1, "experts": [{"uid": "ffn.0", "rows": True}]},
         InvalidRequest, "must be an int64 vector"),
        ([torch.randn(2, HID + 1)], {"inputs": 1, "experts": [{"uid": "ffn.0"}]}, InvalidRequest, "has shape"),
        ([torch.full((2, HID), math.inf)], {"inputs": 1, "experts": [{"uid": "ffn.0"}]},
         InvalidRequest, "NaN or infinite"),
    ],
)
def test_malformed_group_requests_are_refused(served, tensors, metadata, error, fragment) -> None:
    server, client, local = served
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        raw_group_stream(client, server, tensors, metadata)
    x = torch.randn(3, HID)
    answers = forward_group(client, server, [GroupMember("ffn.0")], [x])
    torch.testing.assert_close(answers[0][0], local["ffn.0"](x), **TOL)


def test_a_backward_group_naming_an_unknown_expert_is_refused(served) -> None:
    server, client, _ = served
    x = torch.randn(2, HID)
    with pytest.raises(NotFound, match="'ffn.9' is not hosted"):
        backward_group(client, server, [GroupMember("ffn.0"), GroupMember("ffn.9")], [x],
                       [[torch.ones(2, HID)], [torch.ones(2, HID)]])
    assert all(b.updates == 0 for b in server.backends.values())
