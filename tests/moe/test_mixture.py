"""RemoteMixtureOfExperts and RemoteSwitchMixtureOfExperts over in-process servers and the real DHT.

Numbers are checked against the same mixture computed locally: outputs and input gradients within
rtol=1e-5, atol=1e-6; gating-parameter gradients (sums over the batch, accumulated in another
order) within rtol=1e-4, atol=1e-5.
"""

from __future__ import annotations

import copy
import itertools
import threading

import pytest
import torch
from torch import nn

from swarm.core.errors import MoEError
from swarm.moe import ExpertServer, RemoteMixtureOfExperts, RemoteSwitchMixtureOfExperts
from swarm.moe.client.answer_checks import AnswerChecks
from swarm.moe.client.dispatch import DispatchPolicy
from swarm.moe.client.mixture import MixtureConfig

pytestmark = pytest.mark.timeout(60)
TOL = {"rtol": 1e-5, "atol": 1e-6}
SUM_TOL = {"rtol": 1e-4, "atol": 1e-5}
HID = 12
GRID = (2, 2)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


@pytest.fixture
def swarm_of_two(make_peer):
    """Two servers (rows 0 and 1 of a 2x2 grid of linear experts) and a client-mode peer, one DHT."""
    torch.manual_seed(0)
    modules = {f"ffn.{i}.{j}": nn.Linear(HID, HID) for i, j in itertools.product(range(2), range(2))}
    local = {uid: copy.deepcopy(m) for uid, m in modules.items()}
    first = make_peer()
    second = make_peer(initial_peers=first.addrs)
    servers = [
        ExpertServer(peer, {u: m for u, m in modules.items() if u.startswith(f"ffn.{row}.")}, optimizer_factory=sgd)
        for row, peer in enumerate((first, second))
    ]
    client = make_peer(initial_peers=first.addrs, client_mode=True)
    return client, servers, local


def local_mixture(moe: RemoteMixtureOfExperts, local: dict[str, nn.Module], x: torch.Tensor, alive: set[str]):
    scores = moe.gate(x).split(list(GRID), dim=-1)
    uids = sorted(alive)
    logits = torch.stack([scores[0][:, int(u.split(".")[1])] + scores[1][:, int(u.split(".")[2])] for u in uids], 1)
    weights = logits.softmax(dim=1)
    return sum(weights[:, i : i + 1] * local[u](x) for i, u in enumerate(uids))


def test_mixture_matches_local_and_sends_one_request_per_server(swarm_of_two) -> None:
    client, servers, local = swarm_of_two
    moe = RemoteMixtureOfExperts(client, in_features=HID, grid_size=GRID, uid_prefix="ffn.", k_best=4)
    x = torch.randn(32, HID, requires_grad=True)
    y = moe(x)
    y.square().sum().backward()

    x_local = x.detach().clone().requires_grad_()
    gate_local = copy.deepcopy(moe.gate)
    moe_grads = [p.grad.clone() for p in moe.gate.parameters()]
    moe.gate.zero_grad()
    reference = copy.copy(moe)
    reference.gate = gate_local
    y_local = local_mixture(reference, local, x_local, set(local))
    y_local.square().sum().backward()
    torch.testing.assert_close(y, y_local, **TOL)
    torch.testing.assert_close(x.grad, x_local.grad, **TOL)
    for g, p in zip(moe_grads, gate_local.parameters()):
        torch.testing.assert_close(g, p.grad, **SUM_TOL)
    for server in servers:
        stats = server.stats()
        assert stats["admitted"] == 2  # 1 forward + 1 backward, each carrying both experts of the server
        assert stats["saved_graph_hits"] == 2 and stats["saved_graph_misses"] == 0
        pools = stats["pools"]
        assert all(pools[f"{uid}.{kind}"].rows_processed == 32 for uid in server.experts for kind in ("forward", "backward"))


def test_dead_server_is_skipped_weights_renormalized_and_k_min_enforced(swarm_of_two) -> None:
    client, servers, local = swarm_of_two
    moe = RemoteMixtureOfExperts(client, in_features=HID, grid_size=GRID, uid_prefix="ffn.", k_best=4, k_min=2)
    x = torch.randn(16, HID)
    moe(x)  # every expert answers
    servers[1].peer.shutdown()  # its experts stay declared in the DHT until they expire
    with torch.no_grad():
        y = moe(x)
        expected = local_mixture(moe, local, x, {"ffn.0.0", "ffn.0.1"})
    torch.testing.assert_close(y, expected, **TOL)
    strict = RemoteMixtureOfExperts(client, in_features=HID, grid_size=GRID, uid_prefix="ffn.", k_best=4, k_min=3)
    with pytest.raises(MoEError, match="fewer than k_min=3"):
        strict(x)
    lenient = RemoteMixtureOfExperts(client, in_features=HID, grid_size=GRID, uid_prefix="ffn.", k_best=2,
                                     allow_zero_outputs=True, forward_timeout=5)
    lenient(x)  # learns the experts' output shape
    servers[0].peer.shutdown()
    out = lenient(x)
    assert out.shape == (16, HID) and not out.any()


def test_training_reaches_the_experts_and_the_search_is_cached(swarm_of_two) -> None:
    client, servers, _ = swarm_of_two
    moe = RemoteMixtureOfExperts(client, in_features=HID, grid_size=GRID, uid_prefix="ffn.", k_best=2,
                                 cache_ttl=60)
    opt = torch.optim.SGD(moe.parameters(), lr=0.05)
    x, target = torch.randn(64, HID), torch.randn(64, HID)
    losses = []
    for _ in range(8):
        loss = (moe(x) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert sum(b.updates for s in servers for b in s.backends.values()) >= 8
    assert moe.searcher.source_reads == 3  # "ffn.", "ffn.0.", "ffn.1.": once, not once per batch


def test_switch_routes_to_top_one_and_balances(swarm_of_two) -> None:
    client, _, local = swarm_of_two
    switch = RemoteSwitchMixtureOfExperts(client, in_features=HID, grid_size=GRID, uid_prefix="ffn.")
    x = torch.randn(24, HID, requires_grad=True)
    y, balance = switch(x)
    (y.sum() + balance).backward()
    with torch.no_grad():
        scores = switch.gate(x).split(list(GRID), dim=-1)
        probs = [s.softmax(dim=1) for s in scores]
        top = [p.argmax(dim=1) for p in probs]
        for b in range(24):
            uid = f"ffn.{int(top[0][b])}.{int(top[1][b])}"
            p = probs[0][b, top[0][b]] * probs[1][b, top[1][b]]
            torch.testing.assert_close(y[b], p * local[uid](x[b : b + 1])[0], **TOL)
        expected = sum(
            g * (torch.bincount(t, minlength=g).float() / 24 * p.mean(dim=0)).sum() for g, t, p in zip(GRID, top, probs)
        )
    torch.testing.assert_close(balance.detach(), expected, **TOL)
    assert x.grad is not None and switch.gate.weight.grad is not None and switch.gate.weight.grad.abs().sum() > 0


def test_bad_configuration_is_refused(make_peer) -> None:
    client = make_peer(client_mode=True)
    with pytest.raises(ValueError, match="k_min=3 cannot exceed k_best=2"):
        RemoteMixtureOfExperts(client, in_features=4, grid_size=(2,), uid_prefix="ffn.", k_best=2, k_min=3)
    moe = RemoteMixtureOfExperts(client, in_features=4, grid_size=(2,), uid_prefix="ffn.", k_best=1)
    with pytest.raises(ValueError, match=r"expected input \(\.\.\., 4\)"):
        moe(torch.randn(3, 5))
    config = MixtureConfig(in_features=4, grid_size=(2,), uid_prefix="ffn.", k_best=1)
    with pytest.raises(TypeError, match="not both"):
        RemoteMixtureOfExperts(client, config, k_min=2)
    with pytest.raises(TypeError, match="give a MixtureConfig"):
        RemoteMixtureOfExperts(client, in_features=4, grid_size=(2,), uid_prefix="ffn.")


def test_both_mixtures_take_one_mixture_config(swarm_of_two) -> None:
    client, _, local = swarm_of_two
    config = MixtureConfig(in_features=HID, grid_size=GRID, uid_prefix="ffn.", k_best=4,
                           policy=DispatchPolicy(k_min=4), checks=AnswerChecks(clip_ratio=50.0))
    moe = RemoteMixtureOfExperts(client, config)
    assert moe.config is config and moe.caller.checks.clip_ratio == 50.0
    x = torch.randn(8, HID)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), local_mixture(moe, local, x, set(local)), **TOL)
    switch = RemoteSwitchMixtureOfExperts(client, MixtureConfig(in_features=HID, grid_size=GRID, uid_prefix="ffn.",
                                                                k_best=1))
    y, balance = switch(x)
    assert y.shape == (8, HID) and torch.isfinite(balance)
    assert RemoteSwitchMixtureOfExperts(client, in_features=HID, grid_size=GRID, uid_prefix="ffn.").config.k_best == 1


class Slow(nn.Module):
    """A linear expert that answers only once `release` is set (after the server's sample run)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HID, HID)
        self.release = threading.Event()
        self.release.set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.release.wait(30)
        return self.lin(x)


def test_stragglers_are_dropped_after_timeout_after_k_min(make_peer) -> None:
    fast_peer = make_peer()
    slow_peer = make_peer(initial_peers=fast_peer.addrs)
    fast, slow = nn.Linear(HID, HID), Slow()
    ExpertServer(fast_peer, {"ffn.0.0": fast})
    ExpertServer(slow_peer, {"ffn.0.1": slow})
    client = make_peer(initial_peers=fast_peer.addrs, client_mode=True)
    moe = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(1, 2), uid_prefix="ffn.", k_best=2,
                                 timeout_after_k_min=0.2, forward_timeout=20)
    x = torch.randn(4, HID)
    slow.release.clear()
    try:
        with torch.no_grad():
            y = moe(x)
    finally:
        slow.release.set()
    torch.testing.assert_close(y, fast(x).detach(), **TOL)  # the only answer gets all the weight
    assert moe.caller.failures == 1


class Fragile(nn.Module):
    """A linear expert that raises on inputs holding a value above 100."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HID, HID)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x > 100).any()):
            raise ValueError("input too large")
        return self.lin(x)


def test_an_expert_failing_inside_its_servers_group_call_is_skipped_alone(make_peer) -> None:
    peer = make_peer()
    fragile, healthy = Fragile(), nn.Linear(HID, HID)
    server = ExpertServer(peer, {"ffn.0.0": fragile, "ffn.0.1": healthy}, optimizer_factory=sgd)
    client = make_peer(initial_peers=peer.addrs, client_mode=True)
    moe = RemoteMixtureOfExperts(client, in_features=HID, grid_size=(1, 2), uid_prefix="ffn.", k_best=2)
    x = torch.randn(4, HID)
    x[0, 0] = 1000.0
    x.requires_grad_()
    expected = healthy(x.detach()).detach()  # before its training step
    y = moe(x)
    torch.testing.assert_close(y, expected, **TOL)  # the only answer gets all the weight
    assert moe.caller.failures == 1
    weight = healthy.weight.detach().clone()  # the backward's gradients use the weights before its step
    y.sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(dim=0).expand(4, HID), **TOL)  # the gate's weight is constant
    assert server.backends["ffn.0.1"].updates == 1 and server.backends["ffn.0.0"].updates == 0
