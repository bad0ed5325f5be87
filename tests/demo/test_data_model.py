"""The demo's corpus and model, without a swarm (local experts stand in for the remote mixture)."""

from __future__ import annotations

import torch

from swarm.demo.data import ByteDataset, load_corpus
from swarm.demo.model import ByteLM, LocalExperts, ModelConfig


def test_corpus_ships_with_python_and_splits_into_shifted_windows():
    corpus = load_corpus()
    assert len(corpus) > 300_000 and b"assert" in corpus
    train, held_out = ByteDataset.split(corpus, context=32)
    assert len(train.data) + len(held_out.data) == len(corpus) and len(held_out.data) > 10_000
    x, y = train.batch(4, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes


def test_model_learns_and_generates():
    torch.manual_seed(0)
    config = ModelConfig(hidden_dim=32, context=16, heads=2)
    model = ByteLM(config, LocalExperts(config))
    train, _ = ByteDataset.split(load_corpus(), config.context)
    x, y = train.batch(8, torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.dense_parameters(), lr=2e-2)
    first = model.loss(x, y).item()
    for _ in range(15):
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()
    assert model.loss(x, y).item() < first - 1.0
    text = model.generate(b"The ", 20, torch.Generator().manual_seed(0))
    assert isinstance(text, bytes) and len(text) == 20
    assert config.expert_pattern == "ffn.[0:2].[0:2]"
