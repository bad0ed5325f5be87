"""Tests of swarm.moe.server.backend: schemas, forward, training backward, info and state."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from torch import nn

from swarm.core.errors import InvalidRequest, MoEError
from swarm.moe.schema import TensorSchema
from swarm.moe.server.backend import ExpertBackend

HID = 8


def make_expert(
    *, lr: float = 0.1, scheduler: bool = False, clip: float | None = None, seed: int = 0
) -> ExpertBackend:
    torch.manual_seed(seed)
    module = nn.Linear(HID, HID)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if scheduler else None
    return ExpertBackend(
        "ffn.0.0",
        module,
        optimizer,
        sched,
        args_schema=(TensorSchema((HID,), torch.float32),),
        outputs_schema=(TensorSchema((HID,), torch.float32),),
        max_batch_size=16,
        clip_grad_norm=clip,
    )


# ---- TensorSchema ----------------------------------------------------------------------------


def test_schema_accepts() -> None:
    schema = TensorSchema((3, 4), torch.float32)
    schema.validate(torch.zeros(5, 3, 4), max_batch=5)
    assert TensorSchema.like(torch.zeros(2, 3, 4)) == schema


@pytest.mark.parametrize(
    ("tensor", "fragment"),
    [
        (torch.zeros(2, 3, 4, dtype=torch.float64), "expected dtype float32, got float64"),
        (torch.zeros(2, 4, 3), "expected shape (batch, 3, 4), got (2, 4, 3)"),
        (torch.zeros(2, 12), "expected shape (batch, 3, 4), got (2, 12)"),
        (torch.zeros(3, 4), "expected shape"),
        (torch.zeros(0, 3, 4), "empty"),
        (torch.zeros(6, 3, 4), "batch of 6 rows exceeds the limit of 5"),
        (torch.full((2, 3, 4), math.nan), "NaN or infinite"),
        (torch.full((2, 3, 4), math.inf), "NaN or infinite"),
        ([1.0], "expected a tensor, got list"),
    ],
)
def test_schema_rejects(tensor: object, fragment: str) -> None:
    schema = TensorSchema((3, 4), torch.float32)
    with pytest.raises(InvalidRequest) as info:
        schema.validate(tensor, max_batch=5, what="input 0")
    assert str(info.value).startswith("input 0: ")
    assert fragment in str(info.value)


def test_schema_finite_check_optional_and_int_dtypes() -> None:
    TensorSchema((2,), torch.float32).validate(torch.full((1, 2), math.nan), 1, check_finite=False)
    TensorSchema((2,), torch.int64).validate(torch.ones(1, 2, dtype=torch.int64), 1)


def test_schema_dict_roundtrip() -> None:
    schema = TensorSchema((16, 32), torch.bfloat16)
    data = schema.to_dict()
    assert data == {"shape": [16, 32], "dtype": "bfloat16"}
    assert TensorSchema.from_dict(msgpack.unpackb(msgpack.packb(data))) == schema
    for bad in ({"shape": [1]}, {"shape": [1], "dtype": "nope"}, {"shape": [1], "dtype": "Tensor"}, "x"):
        with pytest.raises(ValueError):
            TensorSchema.from_dict(bad)  # type: ignore[arg-type]


def test_schema_construction_rejects() -> None:
    with pytest.raises(ValueError):
        TensorSchema((-1,), torch.float32)
    with pytest.raises(TypeError):
        TensorSchema((1,), "float32")  # type: ignore[arg-type]


# ---- ExpertBackend ---------------------------------------------------------------------------


def test_forward_matches_module_without_grad() -> None:
    expert = make_expert()
    x = torch.randn(4, HID)
    (y,) = expert.forward(x)
    assert not y.requires_grad
    assert torch.allclose(y, expert.module(x).detach())


def test_forward_rejects_bad_inputs() -> None:
    expert = make_expert()
    with pytest.raises(InvalidRequest, match="expects 1 tensors, got 2"):
        expert.forward(torch.randn(2, HID), torch.randn(2, HID))
    with pytest.raises(InvalidRequest, match="input 0 of expert ffn.0.0: expected shape"):
        expert.forward(torch.randn(2, HID + 1))
    with pytest.raises(InvalidRequest, match="exceeds the limit of 16"):
        expert.forward(torch.randn(17, HID))
    with pytest.raises(InvalidRequest, match="NaN"):
        expert.validate_forward_inputs([torch.full((2, HID), math.nan)])


def test_forward_checks_module_outputs() -> None:
    expert = make_expert()
    expert.outputs_schema = (TensorSchema((HID + 1,), torch.float32),)
    with pytest.raises(MoEError, match="output 0 is float32 \\(2, 8\\)"):
        expert.forward(torch.randn(2, HID))


def test_backward_returns_input_grads_and_trains() -> None:
    expert = make_expert(lr=0.1)
    reference = nn.Linear(HID, HID)
    reference.load_state_dict(expert.module.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    x, g = torch.randn(4, HID), torch.randn(4, HID)
    (grad_x,) = expert.backward(x, g)

    x_ref = x.clone().requires_grad_()
    reference(x_ref).backward(g)
    ref_opt.step()
    assert torch.allclose(grad_x, x_ref.grad)
    assert not grad_x.requires_grad
    for p, q in zip(expert.module.parameters(), reference.parameters()):
        assert torch.allclose(p, q)
        assert p.grad is None  # gradients cleared after the step
    assert expert.updates == 1
    assert not x.requires_grad  # the caller's tensor is untouched


def test_backward_steps_scheduler_and_clips() -> None:
    expert = make_expert(lr=1.0, scheduler=True, clip=1e-3)
    before = [p.detach().clone() for p in expert.module.parameters()]
    expert.backward(torch.randn(4, HID) * 100, torch.randn(4, HID) * 100)
    assert expert.optimizer is not None
    assert expert.optimizer.param_groups[0]["lr"] == 0.5
    delta = torch.cat([(p - b).flatten() for p, b in zip(expert.module.parameters(), before)])
    assert delta.norm() <= 1e-3 * 1.0001  # lr 1.0 * clipped norm


def test_backward_rejects_bad_grads() -> None:
    expert = make_expert()
    with pytest.raises(InvalidRequest, match="expects 2 tensors, got 1"):
        expert.backward(torch.randn(2, HID))
    with pytest.raises(InvalidRequest, match="gradient 0 of expert ffn.0.0"):
        expert.backward(torch.randn(2, HID), torch.randn(2, HID + 1))
    with pytest.raises(InvalidRequest, match="share the batch size"):
        expert.backward(torch.randn(2, HID), torch.randn(3, HID))
    assert expert.updates == 0


def test_backward_without_optimizer_and_with_int_input() -> None:
    class Embed(nn.Module):
        def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    expert = ExpertBackend(
        "nop.0",
        Embed(),
        None,
        args_schema=(TensorSchema((3,), torch.int64), TensorSchema((HID,), torch.float32)),
        outputs_schema=(TensorSchema((HID,), torch.float32),),
        max_batch_size=4,
    )
    ids, x, g = torch.zeros(2, 3, dtype=torch.int64), torch.randn(2, HID), torch.randn(2, HID)
    grad_ids, grad_x = expert.backward(ids, x, g)
    assert torch.equal(grad_ids, torch.zeros_like(ids))
    assert torch.allclose(grad_x, 2 * g)


def test_constructor_validates() -> None:
    module = nn.Linear(2, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    schema = (TensorSchema((2,), torch.float32),)
    with pytest.raises(ValueError, match="max_batch_size"):
        ExpertBackend("e.0", module, opt, args_schema=schema, outputs_schema=schema, max_batch_size=0)
    with pytest.raises(ValueError, match="args_schema"):
        ExpertBackend("e.0", module, opt, args_schema=(), outputs_schema=schema, max_batch_size=1)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        ExpertBackend(
            "e.0", module, opt, args_schema=schema, outputs_schema=schema, max_batch_size=1, clip_grad_norm=0
        )
    with pytest.raises(TypeError, match="optimizer"):
        ExpertBackend("e.0", module, "adam", args_schema=schema, outputs_schema=schema, max_batch_size=1)  # type: ignore[arg-type]


def test_info_is_msgpack_friendly() -> None:
    info = make_expert().info()
    assert msgpack.unpackb(msgpack.packb(info)) == info
    assert info["name"] == "ffn.0.0"
    assert info["class"] == "Linear"
    assert info["args_schema"] == [{"shape": [HID], "dtype": "float32"}]
    assert info["outputs_schema"] == [{"shape": [HID], "dtype": "float32"}]
    assert info["max_batch_size"] == 16
    assert info["num_parameters"] == HID * HID + HID


def test_state_dict_roundtrip_is_a_snapshot() -> None:
    a = make_expert(scheduler=True, seed=1)
    a.backward(torch.randn(3, HID), torch.randn(3, HID))
    state = a.state_dict()
    a.backward(torch.randn(3, HID), torch.randn(3, HID))  # must not change the snapshot
    b = make_expert(scheduler=True, seed=2)
    b.load_state_dict(state)
    assert b.updates == 1
    a.load_state_dict(state)
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)
    assert a.scheduler is not None and b.scheduler is not None
    assert a.scheduler.state_dict() == b.scheduler.state_dict()


def test_load_state_dict_is_all_or_nothing() -> None:
    a = make_expert(seed=1)
    before = {k: v.clone() for k, v in a.module.state_dict().items()}
    bad = make_expert(seed=2).state_dict()
    bad["optimizer"]["param_groups"][0]["params"] = [0]  # module loads, optimizer then fails
    with pytest.raises(ValueError, match="does not fit"):
        a.load_state_dict(bad)
    for k, v in a.module.state_dict().items():
        assert torch.equal(v, before[k])
    with pytest.raises(ValueError, match="has scheduler state"):
        a.load_state_dict(make_expert(scheduler=True).state_dict())
    with pytest.raises(ValueError, match="must have"):
        a.load_state_dict({"module": {}})


def test_finite_check_accepts_large_values_whose_sum_overflows() -> None:
    schema = TensorSchema((4,), torch.float32)
    schema.validate(torch.full((2, 4), 3e38), max_batch=2)  # the sum overflows, every value is finite
    with pytest.raises(InvalidRequest, match="NaN or infinite"):
        schema.validate(torch.tensor([[3e38, 3e38, math.inf, -math.inf]]), max_batch=2)
