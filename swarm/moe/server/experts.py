"""Expert classes a server can host by name (``swarm-peer --expert-cls NAME``), and backends for them.

An expert class is a factory ``factory(hidden_dim) -> torch.nn.Module`` plus a sample input
``sample_input(batch, hidden_dim) -> tuple[Tensor, ...]`` from which the argument and output
schemas are derived. Register new classes with `register_expert_class`.

Built-in classes:

- ``ffn``: a pre-LayerNorm residual feed-forward block,
  ``x + Linear(4h, h)(GELU(Linear(h, 4h)(LayerNorm(x))))`` over ``(batch, h)``.
- ``transformer``: a pre-LayerNorm transformer encoder block over ``(batch, 16, h)``
  (`TRANSFORMER_SEQ_LEN`), ``nhead = max(1, h // 64)`` (lowered to the nearest divisor of
  ``h``), feed-forward width ``4h``, GELU.
- ``nop``: the identity over ``(batch, h)``, without parameters; for tests and benchmarks.

No built-in uses dropout: a backward call recomputes the forward pass, which must match the
one the caller saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from swarm.moe.schema import TensorSchema
from swarm.moe.server.backend import ExpertBackend
from swarm.moe.uids import parse_uid

__all__ = [
    "TRANSFORMER_SEQ_LEN",
    "ExpertClass",
    "backend_for_module",
    "default_optimizer",
    "get_expert_class",
    "known_expert_classes",
    "make_backend",
    "register_expert_class",
]

ModuleFactory = Callable[[int], nn.Module]
SampleInputFn = Callable[[int, int], "tuple[torch.Tensor, ...]"]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]

TRANSFORMER_SEQ_LEN = 16
"""The fixed sequence length of the built-in ``transformer`` expert."""


@dataclass(frozen=True)
class ExpertClass:
    """A registered expert class.

    Attributes:
        name: the name the CLI uses.
        factory: builds the module for a hidden size.
        sample_input: builds a sample batch ``(batch, hidden_dim) -> tuple of tensors``.
    """

    name: str
    factory: ModuleFactory
    sample_input: SampleInputFn


_REGISTRY: dict[str, ExpertClass] = {}


def register_expert_class(
    name: str, sample_input: SampleInputFn, *, replace: bool = False
) -> Callable[[ModuleFactory], ModuleFactory]:
    """Registers an expert class; used as a decorator on its module factory.

    Example::

        @register_expert_class("mlp", lambda batch, hid: (torch.randn(batch, hid),))
        def mlp(hidden_dim: int) -> nn.Module:
            return nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.ReLU())

    Args:
        name: the class's name.
        sample_input: builds a sample batch from ``(batch, hidden_dim)``.
        replace: allow replacing a class already registered under `name`.

    Returns:
        A decorator that registers the factory and returns it unchanged.

    Raises:
        ValueError: `name` is empty or already registered (without `replace`).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"expert class name must be a non-empty str, got {name!r}")
    if not callable(sample_input):
        raise TypeError("sample_input must be callable")
    if name in _REGISTRY and not replace:
        raise ValueError(f"expert class {name!r} is already registered")

    def decorator(factory: ModuleFactory) -> ModuleFactory:
        if not callable(factory):
            raise TypeError("an expert factory must be callable")
        _REGISTRY[name] = ExpertClass(name, factory, sample_input)
        return factory

    return decorator


def known_expert_classes() -> list[str]:
    """Returns the names of the registered expert classes, sorted."""
    return sorted(_REGISTRY)


def get_expert_class(name: str) -> ExpertClass:
    """Looks up a registered expert class.

    Raises:
        ValueError: no class has that name; the message lists the known names.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown expert class {name!r}; known classes: {', '.join(known_expert_classes())}"
        ) from None


def _check_hidden_dim(hidden_dim: int) -> None:
    if not isinstance(hidden_dim, int) or isinstance(hidden_dim, bool) or hidden_dim < 1:
        raise ValueError(f"hidden_dim must be a positive int, got {hidden_dim!r}")


# ---- built-in classes -------------------------------------------------------------------------


class FeedforwardExpert(nn.Module):
    """Pre-LayerNorm residual feed-forward block: ``x + W2(GELU(W1(LayerNorm(x))))``."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        _check_hidden_dim(hidden_dim)
        self.layer_norm = nn.LayerNorm(hidden_dim)
        self.ffn = nn.Linear(hidden_dim, 4 * hidden_dim)
        self.ffn_output = nn.Linear(4 * hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn_output(nn.functional.gelu(self.ffn(self.layer_norm(x))))


class TransformerExpert(nn.Module):
    """Pre-LayerNorm transformer encoder block over ``(batch, seq, hidden_dim)``, no dropout."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        _check_hidden_dim(hidden_dim)
        nhead = max(1, hidden_dim // 64)
        while hidden_dim % nhead:
            nhead -= 1
        self.nhead = nhead
        self.block = nn.TransformerEncoderLayer(
            d_model=hidden_dim,
            nhead=nhead,
            dim_feedforward=4 * hidden_dim,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class NopExpert(nn.Module):
    """The identity; has no parameters, so its backend has no optimizer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@register_expert_class("ffn", lambda batch, hid: (torch.randn(batch, hid),))
def _ffn(hidden_dim: int) -> nn.Module:
    return FeedforwardExpert(hidden_dim)


@register_expert_class("transformer", lambda batch, hid: (torch.randn(batch, TRANSFORMER_SEQ_LEN, hid),))
def _transformer(hidden_dim: int) -> nn.Module:
    return TransformerExpert(hidden_dim)


@register_expert_class("nop", lambda batch, hid: (torch.randn(batch, hid),))
def _nop(hidden_dim: int) -> nn.Module:
    _check_hidden_dim(hidden_dim)
    return NopExpert()


def default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer experts get unless told otherwise: Adam, lr 1e-3.

    The fused implementation where torch has one for the parameters (CPU and CUDA floats): the
    same update, computed in one pass per tensor, about ten times faster on CPU (BENCHMARKS.md,
    "Measurements behind design choices").
    """
    fusable = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.Adam(params, lr=1e-3, fused=True if fusable else None)


def make_backend(
    name: str,
    uid: str,
    hidden_dim: int,
    optimizer_factory: OptimizerFactory = default_optimizer,
    max_batch_size: int = 4096,
    *,
    scheduler_factory: SchedulerFactory | None = None,
    clip_grad_norm: float | None = None,
) -> ExpertBackend:
    """Builds an `ExpertBackend` for the expert class `name`, with schemas from its sample input.

    Args:
        name: a registered expert class, e.g. ``"ffn"``.
        uid: the expert's UID, e.g. ``"ffn.0.0"``.
        hidden_dim: the hidden size passed to the class's factory.
        optimizer_factory: builds the expert's optimizer from its trainable parameters
            (default: Adam, lr 1e-3); not called for a module without trainable parameters.
        max_batch_size: the largest batch the backend accepts.
        scheduler_factory: optionally builds a learning-rate scheduler from the optimizer.
        clip_grad_norm: optionally clip the gradient norm before each step.

    Returns:
        The backend.

    Raises:
        ValueError: unknown class, invalid UID or hidden size, or a module whose outputs do
            not have a batch dimension.
    """
    expert_class = get_expert_class(name)
    parse_uid(uid)
    _check_hidden_dim(hidden_dim)
    module = expert_class.factory(hidden_dim)
    sample = tuple(expert_class.sample_input(2, hidden_dim))
    with torch.no_grad():
        outputs = module(*sample)
    outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = optimizer_factory(params) if params else None
    if scheduler_factory is not None and optimizer is None:
        raise ValueError(f"expert class {name!r} has no trainable parameters to schedule")
    scheduler = scheduler_factory(optimizer) if scheduler_factory is not None and optimizer else None
    return ExpertBackend(
        uid,
        module,
        optimizer,
        scheduler,
        args_schema=tuple(TensorSchema.like(t) for t in sample),
        outputs_schema=tuple(TensorSchema.like(t) for t in outputs),
        max_batch_size=max_batch_size,
        clip_grad_norm=clip_grad_norm,
    )


def backend_for_module(
    uid: str,
    module: nn.Module | ExpertBackend,
    optimizer_factory: OptimizerFactory = default_optimizer,
    args_schema: Sequence[TensorSchema] | None = None,
    max_batch_size: int = 4096,
) -> ExpertBackend:
    """Builds an `ExpertBackend` for a plain module (an `ExpertBackend` is checked and returned as is).

    Args:
        uid: the expert's UID.
        module: the expert's network.
        optimizer_factory: builds its optimizer from its trainable parameters (none: no optimizer).
        args_schema: the input schemas; default: inferred from the module's first ``Linear``
            or 1-d ``LayerNorm``, a float32 ``(batch, features)`` input.
        max_batch_size: the largest batch the backend accepts.

    Raises:
        ValueError: an invalid UID, a backend registered under another UID, or an input
            schema that cannot be inferred.
        TypeError: `module` is neither a module nor a backend.
    """
    parse_uid(uid)
    if isinstance(module, ExpertBackend):
        if module.name != uid:
            raise ValueError(f"backend {module.name!r} is registered under a different uid {uid!r}")
        return module
    if not isinstance(module, nn.Module):
        raise TypeError(f"expert {uid}: expected an nn.Module or ExpertBackend, got {type(module).__name__}")
    schemas = tuple(args_schema) if args_schema is not None else (_infer_input_schema(uid, module),)
    sample = [torch.zeros((2, *s.shape_without_batch), dtype=s.dtype) for s in schemas]
    with torch.no_grad():
        outputs = module(*sample)
    outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    params = [p for p in module.parameters() if p.requires_grad]
    return ExpertBackend(
        uid, module, optimizer_factory(params) if params else None,
        args_schema=schemas, outputs_schema=tuple(TensorSchema.like(o) for o in outputs),
        max_batch_size=max_batch_size,
    )


def _infer_input_schema(uid: str, module: nn.Module) -> TensorSchema:
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            return TensorSchema((sub.in_features,), torch.float32)
        if isinstance(sub, nn.LayerNorm) and len(sub.normalized_shape) == 1:
            return TensorSchema(tuple(sub.normalized_shape), torch.float32)
    raise ValueError(f"expert {uid}: cannot infer its input schema; pass args_schema=[TensorSchema(...)]")
