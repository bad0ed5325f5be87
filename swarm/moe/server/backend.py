"""ExpertBackend: one expert's module, optimizer and schemas, as a server hosts it.

Experts are trained where they live: a backward call computes the gradients w.r.t. the
inputs for the caller *and* applies the expert's own optimizer step to its parameters.

Threading: `ExpertBackend.forward` and `ExpertBackend.backward` are called by the runtime's
compute threads (`swarm.moe.server.runtime.Runtime`), one batch of an expert at a time (its pools form
one group); they are not safe to call concurrently with each other. `state_dict` and `load_state_dict` may be called from any
thread (e.g. a checkpoint saver): they take a lock that the parameter update in `backward`
also holds, so a snapshot never sees a half-applied optimizer step.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

import torch

from swarm.core.errors import InvalidRequest, MoEError
from swarm.moe.protocol import ExpertInfo
from swarm.moe.schema import TensorSchema, dtype_name

__all__ = ["ExpertBackend"]


class ExpertBackend:
    """Hosts one expert: runs forward passes and trains it on backward passes.

    Args:
        name: the expert's UID, used in messages and checkpoints.
        module: the expert's network; called as ``module(*inputs)`` and returning a tensor
            or a tuple of tensors, each with the batch as its first dimension.
        optimizer: the expert's own optimizer over ``module``'s parameters; ``None`` for an
            expert without trainable parameters.
        scheduler: an optional learning-rate scheduler, stepped after each optimizer step.
        args_schema: one schema per input tensor.
        outputs_schema: one schema per output tensor.
        max_batch_size: the largest batch `forward`/`backward` accept.
        clip_grad_norm: if set, clip the parameters' gradient norm to this before each step.

    Raises:
        ValueError: an argument is invalid.
    """

    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        *,
        args_schema: Sequence[TensorSchema],
        outputs_schema: Sequence[TensorSchema],
        max_batch_size: int,
        clip_grad_norm: float | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"expert name must be a non-empty str, got {name!r}")
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if scheduler is not None and optimizer is None:
            raise ValueError("a scheduler needs an optimizer")
        for label, schemas in (("args_schema", args_schema), ("outputs_schema", outputs_schema)):
            if not schemas or not all(isinstance(s, TensorSchema) for s in schemas):
                raise ValueError(f"{label} must be a non-empty sequence of TensorSchema")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be positive or None, got {clip_grad_norm!r}")
        self.name = name
        self.module = module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.args_schema = tuple(args_schema)
        self.outputs_schema = tuple(outputs_schema)
        self.max_batch_size = max_batch_size
        self.clip_grad_norm = clip_grad_norm
        self.updates = 0
        """How many optimizer steps this expert has taken (saved in checkpoints)."""
        self._state_lock = threading.Lock()

    # ---- validation -------------------------------------------------------------------------

    def validate_forward_inputs(self, inputs: Sequence[object], *, check_finite: bool = True) -> None:
        """Checks the arguments of a forward call (one task or a whole batch).

        Raises:
            InvalidRequest: wrong number of tensors, a tensor that fails its schema, or
                tensors whose batch sizes differ.
        """
        self._validate(inputs, self.args_schema, "input", check_finite)

    def validate_backward_inputs(self, inputs: Sequence[object], *, check_finite: bool = True) -> None:
        """Checks the arguments of a backward call: the inputs, then one gradient per output.

        Raises:
            InvalidRequest: as `validate_forward_inputs`, for inputs and gradients together.
        """
        self._validate(inputs, self.args_schema + self.outputs_schema, "argument", check_finite)

    def validate_grad_outputs(self, grads: Sequence[object], *, check_finite: bool = True) -> None:
        """Checks the output gradients of a backward through a kept graph (no inputs).

        Raises:
            InvalidRequest: as `validate_forward_inputs`, for one gradient per output.
        """
        self._validate(grads, self.outputs_schema, "gradient", check_finite, first_grad=0)

    def _validate(
        self, tensors: Sequence[object], schemas: tuple[TensorSchema, ...], label: str, check_finite: bool,
        first_grad: int | None = None,
    ) -> None:
        if len(tensors) != len(schemas):
            raise InvalidRequest(f"expert {self.name} expects {len(schemas)} tensors, got {len(tensors)}")
        if first_grad is None:
            first_grad = len(self.args_schema)
        for i, (tensor, schema) in enumerate(zip(tensors, schemas)):
            what = f"{label} {i} of expert {self.name}"
            if i >= first_grad:
                what = f"gradient {i - first_grad} of expert {self.name}"
            schema.validate(tensor, self.max_batch_size, check_finite=check_finite, what=what)
        batches = {t.shape[0] for t in tensors if isinstance(t, torch.Tensor)}
        if len(batches) > 1:
            raise InvalidRequest(
                f"expert {self.name}: all tensors must share the batch size, got {sorted(batches)}"
            )

    # ---- compute (compute threads, one batch at a time) ----------------------------------------

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Runs the expert on a batch, without building a graph.

        Shapes and dtypes are checked here (cheaply); finiteness is the caller's to check
        per task with `validate_forward_inputs`, so one bad task never fails a whole batch.

        Args:
            *inputs: one tensor per `args_schema` entry, sharing the batch size.

        Returns:
            One tensor per `outputs_schema` entry.

        Raises:
            InvalidRequest: the inputs do not match the schemas.
            MoEError: the module returned outputs that do not match `outputs_schema`.
        """
        self.validate_forward_inputs(inputs, check_finite=False)
        with torch.no_grad():
            outputs = self._checked_outputs(self.module(*inputs), inputs[0].shape[0])
        return outputs

    def backward(self, *inputs_and_grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Returns the gradients w.r.t. the inputs, and trains the expert on them.

        Recomputes the forward pass with gradients enabled, then runs `backward_through`.
        The recomputed forward is assumed to equal the one the caller saw: experts should not
        use dropout.

        Args:
            *inputs_and_grads: the inputs (one per `args_schema` entry) followed by the
                gradients of the loss w.r.t. the outputs (one per `outputs_schema` entry).

        Returns:
            One gradient per input, shaped like it (zeros for non-floating inputs and for
            inputs the outputs do not depend on).

        Raises:
            InvalidRequest: the tensors do not match the schemas.
            MoEError: the module returned outputs that do not match `outputs_schema`.
        """
        self.validate_backward_inputs(inputs_and_grads, check_finite=False)
        num_inputs = len(self.args_schema)
        leaves, outputs = self.forward_with_graph(*inputs_and_grads[:num_inputs])
        return self.backward_through(leaves, outputs, inputs_and_grads[num_inputs:])

    def forward_with_graph(
        self, *inputs: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Runs the expert with autograd on, for a `backward_through` that follows.

        Returns:
            ``(leaves, outputs)``: the inputs as leaves requiring grad (where their dtype
            allows) and the outputs, still attached to the graph.

        Raises:
            InvalidRequest, MoEError: as `forward`.
        """
        self.validate_forward_inputs(inputs, check_finite=False)
        leaves = tuple(x.detach().requires_grad_(x.is_floating_point() or x.is_complex()) for x in inputs)
        with torch.enable_grad():
            outputs = self._checked_outputs(self.module(*leaves), leaves[0].shape[0])
        return leaves, outputs

    def backward_through(
        self,
        leaves: tuple[torch.Tensor, ...],
        outputs: tuple[torch.Tensor, ...],
        grad_outputs: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        """Backpropagates `grad_outputs` through a graph from `forward_with_graph`, then trains.

        After the backward pass it (optionally) clips the parameters' gradient norm, takes one
        optimizer step and one scheduler step, and clears the gradients. The graph is freed.

        Returns:
            One gradient per leaf (zeros where the outputs do not depend on it).
        """
        try:
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        except BaseException:
            self.module.zero_grad(set_to_none=True)  # never let a failed call leak into the next step
            raise
        grads = tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves)
        self._apply_update()
        return tuple(g.detach() for g in grads)

    def _apply_update(self) -> None:
        with self._state_lock:
            if self.optimizer is not None:
                if self.clip_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip_grad_norm)
                self.optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.module.zero_grad(set_to_none=True)
            self.updates += 1

    def _checked_outputs(self, answer: object, batch: int) -> tuple[torch.Tensor, ...]:
        """The module's answer as a tuple of tensors, each checked against `outputs_schema`."""
        outputs = tuple(answer) if isinstance(answer, (tuple, list)) else (answer,)
        if len(outputs) != len(self.outputs_schema):
            raise MoEError(
                f"expert {self.name} returned {len(outputs)} outputs, its schema declares "
                f"{len(self.outputs_schema)}"
            )
        for i, (out, schema) in enumerate(zip(outputs, self.outputs_schema)):
            if (
                not isinstance(out, torch.Tensor)
                or out.dtype != schema.dtype
                or tuple(out.shape) != (batch, *schema.shape_without_batch)
            ):
                got = (
                    f"{dtype_name(out.dtype)} {tuple(out.shape)}"
                    if isinstance(out, torch.Tensor)
                    else type(out).__name__
                )
                raise MoEError(
                    f"expert {self.name} output {i} is {got}, its schema declares "
                    f"{dtype_name(schema.dtype)} {(batch, *schema.shape_without_batch)}"
                )
        return tuple(out for out in outputs if isinstance(out, torch.Tensor))

    # ---- description and state ----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Describes the expert for clients, in a msgpack-friendly dict.

        Returns:
            ``{"name", "class", "args_schema", "outputs_schema", "max_batch_size",
            "num_parameters"}``; schemas are lists of `TensorSchema.to_dict` forms.
        """
        return {
            "name": self.name,
            "class": type(self.module).__name__,
            "args_schema": [s.to_dict() for s in self.args_schema],
            "outputs_schema": [s.to_dict() for s in self.outputs_schema],
            "max_batch_size": self.max_batch_size,
            "num_parameters": sum(p.numel() for p in self.module.parameters()),
        }

    def describe(self) -> ExpertInfo:
        """What clients learn of this expert through the ``Info`` RPC."""
        return ExpertInfo(
            self.name,
            type(self.module).__name__,
            self.args_schema,
            self.outputs_schema,
            self.max_batch_size,
            sum(p.numel() for p in self.module.parameters()),
            self.updates,
        )

    def state_dict(self) -> dict[str, Any]:
        """Returns a consistent snapshot (a deep copy) of module, optimizer and scheduler state.

        Safe to call from any thread while a compute thread trains the expert.
        """
        with self._state_lock:
            return copy.deepcopy(
                {
                    "module": self.module.state_dict(),
                    "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                    "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                    "updates": self.updates,
                }
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the state `state_dict` returned; all of it or nothing.

        Call it before the runtime serves this expert (not concurrently with `forward`).

        Raises:
            ValueError: the state is malformed or does not fit this expert (missing keys,
                wrong shapes, an optimizer or scheduler state where none exists or vice
                versa); the expert is left as it was.
        """
        if not isinstance(state, dict) or not {"module", "optimizer", "scheduler"} <= state.keys():
            raise ValueError(f"expert {self.name}: state must have module, optimizer and scheduler")
        for key, target in (("optimizer", self.optimizer), ("scheduler", self.scheduler)):
            if (state[key] is None) != (target is None):
                raise ValueError(
                    f"expert {self.name}: the state {'lacks' if state[key] is None else 'has'} "
                    f"{key} state but the expert {'has' if target is not None else 'has no'} {key}"
                )
        with self._state_lock:
            backup = copy.deepcopy(
                {
                    "module": self.module.state_dict(),
                    "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                    "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                }
            )
            try:
                self._load(state)
                self.updates = int(state.get("updates", 0))
            except Exception as e:
                self._load(backup)
                raise ValueError(f"expert {self.name}: state does not fit: {e}") from e

    def _load(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def __repr__(self) -> str:
        return f"ExpertBackend({self.name!r}, {type(self.module).__name__}, updates={self.updates})"
