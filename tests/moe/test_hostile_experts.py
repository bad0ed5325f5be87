"""Hostile expert servers and hostile clients of experts, over real servers on loopback.

One honest server holds ``ffn.0``; a second holds ``ffn.1`` and lies in each answer in the way its
`ExpertServerConfig.hostile` says (the server's own fault hook). A client's mixture over both
(k_best=2, k_min=1) trains a linear regression; it must keep stepping, its loss must fall, its
outputs and input gradients must stay within the documented bounds, and the honest expert's
parameters must stay sane. A hostile client sends the honest expert gradients x1e6.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swarm.moe import ExpertServer, ExpertServerConfig, RemoteExpert, RemoteMixtureOfExperts
from swarm.moe.client.answer_checks import AnswerChecks, MisbehavingExpert
from swarm.moe.sources import StaticExpertSource

pytestmark = pytest.mark.timeout(90)
HID = 16
STEPS = 24


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def serve(make_peer, uid: str, hostile: str | None = None, seed: int = 0) -> tuple[ExpertServer, nn.Linear]:
    torch.manual_seed(seed)
    module = nn.Linear(HID, HID)
    config = ExpertServerConfig(hostile=hostile, checkpoint_interval=None)
    return ExpertServer(make_peer(), {uid: module}, optimizer_factory=sgd, config=config, declare=False), module


@pytest.fixture
def honest_and_hostile(make_peer, request):
    """`(client peer, source, honest module, hostile server)` for the hostile mode the test is given."""
    honest, module = serve(make_peer, "ffn.0", seed=0)
    hostile, _ = serve(make_peer, "ffn.1", hostile=request.param, seed=1)
    source = StaticExpertSource({"ffn.0": honest.peer.addrs[0], "ffn.1": hostile.peer.addrs[0]})
    return make_peer(client_mode=True), source, module, hostile


def train(moe: RemoteMixtureOfExperts, steps: int) -> tuple[list[float], list[float], list[float]]:
    """Fits y = x A with the mixture; per step the loss, the largest output row norm and the largest
    input-gradient row norm."""
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(HID, HID, generator=gen) / HID**0.5
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.05)
    losses, out_norms, grad_norms = [], [], []
    for _ in range(steps):
        x = torch.randn(32, HID, generator=gen, requires_grad=True)
        y = moe(x)
        loss = (y - x.detach() @ target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        out_norms.append(float(y.detach().norm(dim=1).max()))
        grad_norms.append(float(x.grad.norm(dim=1).max()))
    return losses, out_norms, grad_norms


@pytest.mark.parametrize("honest_and_hostile", ["x1e6", "nan", "shape", "sometimes"], indirect=True)
def test_a_hostile_expert_server_cannot_poison_or_stall_a_mixture(honest_and_hostile) -> None:
    client, source, honest, hostile = honest_and_hostile
    start = torch.cat([p.detach().flatten() for p in honest.parameters()]).norm()
    moe = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(2,), uid_prefix="ffn.", k_best=2, k_min=1,
                                 source=source)
    losses, out_norms, grad_norms = train(moe, STEPS)  # any failed step raises MoEError
    # every step trained, and the loss fell (mean of the last 4 steps below 80% of the first 4)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses
    # the outputs and input gradients stay bounded: no row over clip_ratio x a reference that honest
    # answers set (inputs of norm ~4, honest outputs of the same order)
    assert max(out_norms) < 100 and max(grad_norms) < 100, (out_norms, grad_norms)
    # the liar was caught, counted, and its server avoided
    assert moe.caller.misbehaviours >= 1 and moe.caller.failures >= moe.caller.misbehaviours
    assert moe.searcher.avoided_servers() == [hostile.peer.addrs[0]], "the hostile server is avoided for a while"
    end = torch.cat([p.detach().flatten() for p in honest.parameters()]).norm()
    assert torch.isfinite(end) and float(end) < 2 * float(start) + 1


@pytest.mark.parametrize("honest_and_hostile", ["x1e6"], indirect=True)
def test_without_checks_the_same_liar_poisons_the_mixture(honest_and_hostile) -> None:
    # the counterpart of the test above: what the checks change (x1e6 answers pass and dominate)
    client, source, _, _ = honest_and_hostile
    moe = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(2,), uid_prefix="ffn.", k_best=2, k_min=1,
                                 source=source, checks=AnswerChecks(enabled=False))
    _, out_norms, _ = train(moe, 1)
    assert max(out_norms) > 1e4


def test_a_hostile_client_sending_huge_gradients_cannot_wreck_an_honest_expert(make_peer) -> None:
    server, module = serve(make_peer, "ffn.0")
    client = make_peer(client_mode=True)
    source = StaticExpertSource({"ffn.0": server.peer.addrs[0]})
    moe = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(1,), uid_prefix="ffn.", k_best=1, source=source)
    attacker = RemoteExpert(make_peer(client_mode=True), "ffn.0", server.peer.addrs[0])
    gen = torch.Generator().manual_seed(3)
    losses, _, _ = train(moe, 10)  # the honest client's batches set the expert's reference
    before = torch.cat([p.detach().flatten() for p in module.parameters()]).norm()
    for _ in range(5):
        x = torch.randn(32, HID, generator=gen, requires_grad=True)
        (attacker(x).square().mean() * 1e6).backward()
    after = torch.cat([p.detach().flatten() for p in module.parameters()]).norm()
    assert torch.isfinite(after) and float(after) < 3 * float(before), (before, after)
    assert server.experts["ffn.0"].gradient_bound is not None
    assert server.experts["ffn.0"].gradient_bound.clipped_rows >= 5 * 32
    more, _, _ = train(moe, 10)  # the honest client goes on training, its loss below where it began
    assert all(torch.isfinite(torch.tensor(more))) and sum(more[-3:]) < 0.8 * sum(losses[:3]), (losses, more)


@pytest.mark.parametrize("honest_and_hostile", ["nan"], indirect=True)
def test_samples_routed_only_to_a_liar_are_rerouted_in_the_same_forward(honest_and_hostile) -> None:
    client, source, honest, hostile = honest_and_hostile
    moe = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(2,), uid_prefix="ffn.", k_best=1, k_min=1,
                                 source=source)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.bias.copy_(torch.tensor([0.0, 10.0]))  # every sample prefers ffn.1, the liar
    x = torch.randn(8, HID)
    with torch.no_grad():
        expected = honest(x)
        y = moe(x)  # the liar's answer is rejected; the same call searches again and asks ffn.0
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    assert moe.caller.misbehaviours == 1 and moe.searcher.avoided_servers() == [hostile.peer.addrs[0]]


def rejected_total(direction: str, reason: str) -> float:
    from swarm.metrics import MOE_REJECTED_ANSWERS, REGISTRY

    assert MOE_REJECTED_ANSWERS is not None  # the counter exists before it is read
    return REGISTRY.value("swarm_moe_rejected_answers_total", direction=direction, reason=reason) or 0.0


@pytest.mark.parametrize(("mode", "reason"), [("nan", "not_finite"), ("shape", "shape")])
def test_a_single_remote_expert_refuses_a_hostile_answer_with_a_typed_error(make_peer, mode, reason) -> None:
    # no k_min for one expert: the caller gets MisbehavingExpert, counted and logged, never the lie
    server, _ = serve(make_peer, "ffn.1", hostile=mode)
    expert = RemoteExpert(make_peer(client_mode=True), "ffn.1", server.peer.addrs[0])
    before = {d: rejected_total(d, reason) for d in ("forward", "backward")}
    x = torch.randn(8, HID, requires_grad=True)
    with pytest.raises(MisbehavingExpert, match="ffn.1") as caught:
        expert(x)
    assert caught.value.reason == reason and x.grad is None
    with pytest.raises(MisbehavingExpert) as caught:  # its input gradients are checked too
        expert.peer.run(expert.acall_backward([x.detach()], [torch.randn(8, HID)]), 30)
    assert caught.value.reason == reason
    assert expert.guard.rejected == 2
    assert {d: rejected_total(d, reason) - before[d] for d in before} == {"forward": 1, "backward": 1}


def test_a_single_remote_expert_catches_a_liar_from_its_own_earlier_answers(make_peer) -> None:
    # "sometimes": every third batch of each direction x1e6; the bound is learned from the honest two
    server, module = serve(make_peer, "ffn.1", hostile="sometimes")
    expert = RemoteExpert(make_peer(client_mode=True), "ffn.1", server.peer.addrs[0])
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):  # forward and backward batches 1 and 2: honest, accepted
        x = torch.randn(8, HID, generator=gen, requires_grad=True)
        y = expert(x)
        torch.testing.assert_close(y, module(x.detach()).detach(), rtol=1e-5, atol=1e-6)
        y.square().mean().backward()
    x = torch.randn(8, HID, generator=gen)
    with pytest.raises(MisbehavingExpert) as caught:  # backward batch 3: x1e6
        expert.peer.run(expert.acall_backward([x], [torch.randn(8, HID, generator=gen)]), 30)
    assert caught.value.reason == "magnitude"
    with pytest.raises(MisbehavingExpert) as caught:  # forward batch 3: x1e6
        expert(x)
    assert caught.value.reason == "magnitude"
    y = expert(x)  # forward batch 4: honest again, and accepted
    assert float(y.detach().norm(dim=1).max()) < 100 and expert.guard.rejected == 2
