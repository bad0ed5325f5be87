"""Tests of swarm.moe.server.experts: the expert-class registry and make_backend."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swarm.moe.schema import TensorSchema
from swarm.moe.server.backend import ExpertBackend
from swarm.moe.server.experts import (
    TRANSFORMER_SEQ_LEN,
    TransformerExpert,
    get_expert_class,
    known_expert_classes,
    make_backend,
    register_expert_class,
)


def test_builtins_are_registered() -> None:
    assert {"ffn", "transformer", "nop"} <= set(known_expert_classes())


def test_unknown_class_lists_known_names() -> None:
    with pytest.raises(
        ValueError, match="unknown expert class 'nope'; known classes: .*ffn.*nop.*transformer"
    ):
        get_expert_class("nope")


@pytest.mark.parametrize(
    ("name", "row_shape"),
    [("ffn", (16,)), ("transformer", (TRANSFORMER_SEQ_LEN, 16)), ("nop", (16,))],
)
def test_make_backend_builtins(name: str, row_shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    backend = make_backend(name, "expert.0.1", 16, max_batch_size=8)
    assert isinstance(backend, ExpertBackend)
    assert backend.name == "expert.0.1"
    assert backend.max_batch_size == 8
    assert backend.args_schema == (TensorSchema(row_shape, torch.float32),)
    assert backend.outputs_schema == (TensorSchema(row_shape, torch.float32),)
    x = torch.randn(3, *row_shape)
    (y,) = backend.forward(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    (grad,) = backend.backward(x, torch.randn_like(y))
    assert grad.shape == x.shape
    assert backend.updates == 1
    assert (backend.optimizer is None) == (name == "nop")


def test_ffn_is_pre_ln_residual_and_trains() -> None:
    torch.manual_seed(0)
    backend = make_backend("ffn", "ffn.0.0", 8)
    module = backend.module
    x = torch.randn(4, 8)
    expected = x + module.ffn_output(nn.functional.gelu(module.ffn(module.layer_norm(x))))
    (y,) = backend.forward(x)
    assert torch.allclose(y, expected.detach())
    assert isinstance(backend.optimizer, torch.optim.Adam)
    before = [p.detach().clone() for p in module.parameters()]
    backend.backward(x, torch.ones_like(y))
    assert any(not torch.equal(p, b) for p, b in zip(module.parameters(), before))


def test_nop_is_identity() -> None:
    backend = make_backend("nop", "nop.0", 4)
    x, g = torch.randn(2, 4), torch.randn(2, 4)
    assert torch.equal(backend.forward(x)[0], x)
    assert torch.equal(backend.backward(x, g)[0], g)


@pytest.mark.parametrize(("hidden", "heads"), [(16, 1), (64, 1), (128, 2), (200, 2), (192, 3)])
def test_transformer_heads(hidden: int, heads: int) -> None:
    assert TransformerExpert(hidden).nhead == heads


def test_make_backend_options() -> None:
    backend = make_backend(
        "ffn",
        "ffn.1",
        4,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.5),
        scheduler_factory=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1),
        clip_grad_norm=1.0,
    )
    assert isinstance(backend.optimizer, torch.optim.SGD)
    assert backend.scheduler is not None and backend.clip_grad_norm == 1.0
    backend.backward(torch.randn(2, 4), torch.randn(2, 4))
    assert backend.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_make_backend_rejects() -> None:
    with pytest.raises(ValueError, match="invalid expert uid"):
        make_backend("ffn", "not a uid", 4)
    with pytest.raises(ValueError, match="hidden_dim"):
        make_backend("ffn", "ffn.0", 0)
    with pytest.raises(ValueError, match="unknown expert class"):
        make_backend("nope", "ffn.0", 4)
    with pytest.raises(ValueError, match="no trainable parameters"):
        make_backend("nop", "nop.0", 4, scheduler_factory=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))


def test_register_custom_class() -> None:
    @register_expert_class("test-two-in", lambda batch, hid: (torch.randn(batch, hid), torch.randn(batch, 2)))
    def two_in(hidden_dim: int) -> nn.Module:
        class TwoIn(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.proj = nn.Linear(hidden_dim + 2, hidden_dim)

            def forward(self, x: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return self.proj(torch.cat([x, extra], dim=1)), extra.sum(dim=1)

        return TwoIn()

    assert get_expert_class("test-two-in").factory is two_in
    backend = make_backend("test-two-in", "two.0", 6)
    assert backend.args_schema == (TensorSchema((6,), torch.float32), TensorSchema((2,), torch.float32))
    assert backend.outputs_schema == (TensorSchema((6,), torch.float32), TensorSchema((), torch.float32))
    with pytest.raises(ValueError, match="already registered"):
        register_expert_class("test-two-in", lambda b, h: (torch.randn(b, h),))
    register_expert_class("test-two-in", lambda b, h: (torch.randn(b, h),), replace=True)(
        lambda h: nn.Identity()
    )
    with pytest.raises(ValueError, match="non-empty"):
        register_expert_class("", lambda b, h: (torch.randn(b, h),))
