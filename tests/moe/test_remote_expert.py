"""RemoteExpert against an in-process ExpertServer: the same numbers as the module run locally.

Tolerance: outputs, input gradients and updated parameters must match the local computation
within rtol=1e-5, atol=1e-6 (float32; both sides run the same CPU kernels, so in practice the
results are bitwise equal).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from swarm.core.errors import MoEError
from swarm.moe import ExpertServer, RemoteExpert
from swarm.moe.protocol import BACKWARD
from swarm.moe.schema import TensorSchema
from swarm.moe.server.backend import ExpertBackend
from swarm.moe.server.experts import FeedforwardExpert

pytestmark = pytest.mark.timeout(60)
TOL = {"rtol": 1e-5, "atol": 1e-6}
HID = 32


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


@pytest.mark.parametrize("make_optimizer", [sgd, adam], ids=["sgd", "adam"])
def test_outputs_gradients_and_training_step_match_local(make_peer, make_optimizer) -> None:
    torch.manual_seed(0)
    module = FeedforwardExpert(HID)
    local = copy.deepcopy(module)
    local_opt = make_optimizer(list(local.parameters()))
    server_peer, client = make_peer(), make_peer(client_mode=True)
    server = ExpertServer(server_peer, {"ffn.0.0": module}, optimizer_factory=make_optimizer, declare=False)
    expert = RemoteExpert(client, "ffn.0.0", server_peer.addrs[0])
    for step in range(3):
        x = torch.randn(8, HID)
        target = torch.randn(8, HID)
        x_remote = x.clone().requires_grad_()
        y_remote = expert(x_remote)
        ((y_remote - target) ** 2).mean().backward()

        x_local = x.clone().requires_grad_()
        y_local = local(x_local)
        ((y_local - target) ** 2).mean().backward()
        local_opt.step()
        local_opt.zero_grad()

        torch.testing.assert_close(y_remote, y_local, **TOL)
        torch.testing.assert_close(x_remote.grad, x_local.grad, **TOL)
        for (name, p_remote), p_local in zip(server.backends["ffn.0.0"].module.named_parameters(), local.parameters()):
            torch.testing.assert_close(p_remote.detach(), p_local.detach(), **TOL, msg=f"{name} after step {step}")
    assert expert.info.updates == 3
    stats = server.stats()
    assert stats["saved_graph_hits"] == 3 and stats["saved_graph_misses"] == 0  # no forward was recomputed


def test_backward_after_another_step_recomputes_at_the_new_parameters(make_peer) -> None:
    torch.manual_seed(1)
    module = nn.Linear(HID, HID)
    local = copy.deepcopy(module)
    server_peer, client = make_peer(), make_peer(client_mode=True)
    server = ExpertServer(server_peer, {"lin.0": module}, optimizer_factory=sgd, declare=False)
    expert = RemoteExpert(client, "lin.0", server_peer.addrs[0])
    local_opt = sgd(list(local.parameters()))
    xa, xb = torch.randn(4, HID, requires_grad=True), torch.randn(4, HID, requires_grad=True)
    ya, yb = expert(xa), expert(xb)  # two forwards, then their backwards: b's runs after a's step
    ya.sum().backward()
    yb.sum().backward()
    for x in (xa, xb):
        x_local = x.detach().clone().requires_grad_()
        local(x_local).sum().backward()
        local_opt.step()
        local_opt.zero_grad()
    stats = server.stats()
    assert stats["saved_graph_hits"] == 1 and stats["saved_graph_misses"] == 1
    for p_remote, p_local in zip(server.backends["lin.0"].module.parameters(), local.parameters()):
        torch.testing.assert_close(p_remote.detach(), p_local.detach(), **TOL)


class TwoInTwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(HID, 3)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x) + self.b(z)
        return h, h.sum(dim=1)


def test_several_inputs_and_outputs_and_no_grad_forward(make_peer) -> None:
    torch.manual_seed(2)
    module = TwoInTwoOut()
    local = copy.deepcopy(module)
    server_peer, client = make_peer(), make_peer(client_mode=True)
    backend = ExpertBackend(
        "two.0", module, None,
        args_schema=(TensorSchema((HID,), torch.float32), TensorSchema((5,), torch.float32)),
        outputs_schema=(TensorSchema((3,), torch.float32), TensorSchema((), torch.float32)),
        max_batch_size=64,
    )
    server = ExpertServer(server_peer, {"two.0": backend}, declare=False)
    expert = RemoteExpert(client, "two.0", server_peer.addrs[0])
    info = expert.info
    assert [s.shape_without_batch for s in info.args_schema] == [(HID,), (5,)]
    assert [s.shape_without_batch for s in info.outputs_schema] == [(3,), ()]
    x, z = torch.randn(6, HID, requires_grad=True), torch.randn(6, 5, requires_grad=True)
    h, s = expert(x, z)
    (h.square().sum() + s.sum()).backward()
    xl, zl = x.detach().clone().requires_grad_(), z.detach().clone().requires_grad_()
    hl, sl = local(xl, zl)
    (hl.square().sum() + sl.sum()).backward()
    torch.testing.assert_close(h, hl, **TOL)
    torch.testing.assert_close(x.grad, xl.grad, **TOL)
    torch.testing.assert_close(z.grad, zl.grad, **TOL)
    with torch.no_grad():
        h2, _ = expert(x, z)
    torch.testing.assert_close(h2, hl, **TOL)
    assert server.stats()["saved_graph_rows"] == 0  # a no-grad forward keeps no graph


def test_address_is_looked_up_in_the_dht(make_peer) -> None:
    server_peer = make_peer()
    module = nn.Linear(HID, HID)
    ExpertServer(server_peer, {"lin.4": module})
    client = make_peer(initial_peers=server_peer.addrs, client_mode=True)
    x = torch.randn(2, HID)
    with torch.no_grad():
        torch.testing.assert_close(RemoteExpert(client, "lin.4")(x), module(x), **TOL)
    with pytest.raises(MoEError, match="lin.5 is not declared by any live server"):
        RemoteExpert(client, "lin.5")(x)


def test_backward_sends_the_inputs_only_when_the_server_lost_the_graph(make_peer) -> None:
    torch.manual_seed(3)
    module = nn.Linear(HID, HID)
    local = copy.deepcopy(module)
    server_peer, client = make_peer(), make_peer(client_mode=True)
    server = ExpertServer(server_peer, {"lin.0": module}, optimizer_factory=sgd, declare=False)
    expert = RemoteExpert(client, "lin.0", server_peer.addrs[0])
    received = server_peer.server.metrics.method(BACKWARD).received
    tensor_bytes = 64 * HID * 4

    x = torch.randn(64, HID, requires_grad=True)
    before = received.value
    expert(x).sum().backward()  # the graph was kept: the gradients travel alone
    assert tensor_bytes <= received.value - before < 2 * tensor_bytes

    xa, xb = torch.randn(64, HID, requires_grad=True), torch.randn(64, HID, requires_grad=True)
    ya, yb = expert(xa), expert(xb)
    ya.sum().backward()  # a step: b's graph is gone, so b's backward is sent again with its inputs
    before = received.value
    yb.sum().backward()
    assert received.value - before >= 3 * tensor_bytes
    local_opt = sgd(list(local.parameters()))
    for inputs in (x, xa, xb):
        x_local = inputs.detach().clone().requires_grad_()
        local(x_local).sum().backward()
        local_opt.step()
        local_opt.zero_grad()
        torch.testing.assert_close(inputs.grad, x_local.grad, **TOL)
    for p_remote, p_local in zip(module.parameters(), local.parameters()):
        torch.testing.assert_close(p_remote.detach(), p_local.detach(), **TOL)
    assert server.stats()["saved_graph_hits"] == 2 and server.stats()["saved_graph_misses"] == 1
