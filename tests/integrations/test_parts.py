"""The integrations' framework-free parts: fingerprints, the per-peer sampler, the model check at the door."""

from __future__ import annotations

import logging

import pytest
import torch
from fast import FAST

from swarm.core.errors import ConfigError
from swarm.integrations.admission import AdmissionConfig
from swarm.integrations.data import PeerShardSampler, peer_seed
from swarm.integrations.fingerprint import ModelFingerprint, ModelMismatchError, model_fingerprint
from swarm.integrations.session import SwarmArguments, SwarmSession, SwarmTorchOptimizer, batch_size_of


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 32, width: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def test_fingerprints_name_what_differs():
    a, b = model_fingerprint(TinyLM(32)), model_fingerprint(TinyLM(40))
    assert a == model_fingerprint(TinyLM(32)) and a.digest == model_fingerprint(TinyLM(32)).digest
    assert a.vocab_size == 32 and a.num_params == 32 * 8 + 8 * 32 + 32 and a.num_tensors == 3
    diffs = " ".join(a.differences(b))
    assert "vocab_size 32 here vs 40 there" in diffs and "num_params" in diffs and a.digest != b.digest
    wider = model_fingerprint(TinyLM(32, width=9))
    assert "vocab_size" not in " ".join(a.differences(wider)) and "shapes" in " ".join(a.differences(wider))


def test_a_malformed_fingerprint_record_is_ignored():
    good = model_fingerprint(TinyLM()).to_record()
    assert ModelFingerprint.from_record(good) == model_fingerprint(TinyLM())
    for bad in (None, "x", {**good, "num_params": "12"}, {k: v for k, v in good.items() if k != "shapes"},
                {**good, "vocab_size": 1.5}, {**good, "num_tensors": True}):
        assert ModelFingerprint.from_record(bad) is None


def test_peers_draw_the_data_in_their_own_orders_and_each_pass_covers_it_once():
    n = 1000
    a, b = PeerShardSampler(n, peer_seed("peer-a", "run")), PeerShardSampler(n, peer_seed("peer-b", "run"))
    ia, ib = iter(a), iter(b)
    first_a, first_b = [next(ia) for _ in range(n)], [next(ib) for _ in range(n)]
    assert sorted(first_a) == list(range(n)) and sorted(first_b) == list(range(n))
    # at any moment the peers train on different samples: their first tenths barely overlap
    assert len(set(first_a[:100]) & set(first_b[:100])) < 40
    second = [next(ia) for _ in range(n)]
    assert sorted(second) == list(range(n)) and second != first_a  # a new order each pass


def test_a_resumed_sampler_goes_on_where_it_stopped():
    sampler = PeerShardSampler(100, peer_seed("peer-a", "run"))
    it = iter(sampler)
    seen = [next(it) for _ in range(130)]
    state = sampler.state_dict()
    rest = [next(it) for _ in range(50)]
    resumed = PeerShardSampler(100, 0)
    resumed.load_state_dict(state)
    assert resumed.position == 130 and [i for i, _ in zip(resumed, range(50))] == rest
    assert not set(seen[100:]) & set(rest[:70])  # nothing of the pass trained before the restart again
    with pytest.raises(ValueError, match="dataset of 100 samples, this one has 7"):
        PeerShardSampler(7, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="not a sampler state"):
        resumed.load_state_dict({"seed": 1})


def test_the_ranks_of_a_job_share_its_order_and_resume_from_any_ranks_position():
    """A torchrun job is one peer: its K ranks draw disjoint shares of the peer's order, together
    exactly that order (across a pass boundary too), stay at one position, and a position saved by
    rank 0 resumes every rank where the job stopped."""
    n, k, rows = 10, 3, 9  # 27 indices: 2.7 passes, rows straddling the passes' ends
    whole = iter(PeerShardSampler(n, peer_seed("machine", "run")))
    ranks = [PeerShardSampler(n, peer_seed("machine", "run"), rank, k) for rank in range(k)]
    its = [iter(r) for r in ranks]
    drawn = [[next(it) for it in its] for _ in range(rows)]
    assert [i for row in drawn for i in row] == [next(whole) for _ in range(rows * k)]
    assert {r.position for r in ranks} == {rows * k}
    state = ranks[0].state_dict()
    resumed = []
    for rank in range(k):
        sampler = PeerShardSampler(n, 0, rank, k)
        sampler.load_state_dict(state)
        resumed.append(next(iter(sampler)))
    assert resumed == [next(whole) for _ in range(k)]  # the next row, nothing skipped or repeated
    for rank, of in ((3, 3), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="rank must be in"):
            PeerShardSampler(n, 0, rank, of)


def test_arguments_are_checked():
    with pytest.raises(ConfigError, match="target_batch_size"):
        SwarmArguments(run_id="r")
    with pytest.raises(ConfigError, match="run_id"):
        SwarmArguments(run_id="a b", target_batch_size=4)
    with pytest.raises(TypeError, match="sequence of multiaddrs"):
        SwarmArguments(run_id="r", target_batch_size=4, initial_peers="/ip4/1.2.3.4/tcp/1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="expiration"):
        AdmissionConfig(period=5, expiration=6)


def test_batch_sizes_are_read_from_the_batch():
    assert batch_size_of(torch.zeros(5, 3)) == 5
    assert batch_size_of({"input_ids": torch.zeros(4, 7), "labels": torch.zeros(4, 7)}) == 4
    assert batch_size_of((torch.zeros(3, 2), torch.zeros(3))) == 3
    assert batch_size_of({"meta": "x"}) == 0


def _session(peer, model, admission=None):
    args = SwarmArguments(run_id="door", target_batch_size=8, collaboration=FAST,
                          admission=admission or AdmissionConfig(period=0.2, expiration=5.0))
    return SwarmSession(args, model, torch.optim.SGD(model.parameters(), lr=0.1), peer=peer)


def test_a_peer_with_another_model_is_refused_on_both_sides_before_averaging(swarm_peers, caplog):
    first, second, third = swarm_peers(3)
    running = _session(first, TinyLM(32))
    with caplog.at_level(logging.ERROR, logger="swarm.integrations.admission"):
        with pytest.raises(ModelMismatchError) as refused:
            _session(second, TinyLM(40))
        message = str(refused.value)
        # the newcomer's error names the peer it met and both sides' values
        assert first.peer_id in message and "vocab_size 40 here vs 32 there" in message
        assert "num_params" in message
        # the running peer turns the newcomer away too, naming the same difference from its side
        assert running.admission.wait_for_refusal(second.peer_id, timeout=10)
        assert "vocab_size 32 here vs 40 there" in running.admission.refused[second.peer_id]
        assert any(second.peer_id in r.getMessage() for r in caplog.records)
    # the refused peer never built an optimizer: the run's progress records hold the running peer only
    assert running.optimizer.progress.num_peers == 1
    # a peer with the same model is let in
    joined = _session(third, TinyLM(32))
    assert joined.optimizer.wait_for_peers(2, timeout=10)
    running.shutdown()
    joined.shutdown()


def test_the_torch_face_steps_the_swarm_and_carries_its_state(swarm_peers):
    (peer,) = swarm_peers(1)
    model = TinyLM()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    adapter = SwarmTorchOptimizer(inner)
    assert adapter.state_dict() == inner.state_dict()  # unbound: the wrapped optimizer itself
    session = SwarmSession(SwarmArguments(run_id="face", target_batch_size=8, collaboration=FAST), model, inner,
                           peer=peer)
    adapter.bind(session)
    assert adapter.param_groups is inner.param_groups
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="holds no samples"):
        adapter.step()  # nothing counted: refused, nothing handed to the swarm
    for _ in range(2):
        batch = torch.randint(0, 32, (4, 3))
        adapter.count({"input_ids": batch})
        model(batch).sum().backward()
        adapter.step()
        adapter.zero_grad()
    assert session.global_step == 1  # 2 x 4 samples: the target, taken alone
    adapter.count(torch.zeros(4, 3))
    adapter.discard_samples()  # a step the gradient scaler skipped
    with pytest.raises(ValueError, match="holds no samples"):
        adapter.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    state = adapter.state_dict()
    assert state["swarm_optimizer"]["metadata"]["epoch"] == 1
    with pytest.raises(ConfigError, match="fixed"):
        adapter.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
    session.shutdown()


def test_swarm_and_the_shared_parts_import_no_framework():
    import subprocess
    import sys

    code = ("import sys, swarm; swarm.Optimizer; import swarm.integrations.session, swarm.integrations.data; "
            "print(sorted(m for m in ('transformers', 'lightning', 'accelerate', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
