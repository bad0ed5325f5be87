"""HostedExpert: one expert as a server runs it: its backend, its task pools, its saved graphs.

Requests reach the expert through `TaskPool`s (forward, backward, and backward through a kept
graph) served by the server's `Runtime`, so concurrent callers are merged into batches. The pools
form one group: batches of one expert never run at the same time. The batch functions here run on
a compute thread and decide, per batch, whether a forward keeps its graph (it ran alone and
carries a graph id) and whether a backward can reuse one (`swarm.moe.server.saved_graphs`). A forward
tells its caller whether it kept the graph, so that the backward may leave the inputs out (the
server has them); if the graph is gone by then, that backward fails with `GraphGone` and the
caller sends the inputs after all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from swarm.core.errors import ConfigError, InvalidRequest, MoEError
from swarm.metrics import EXPERT_BATCHES, EXPERT_CLIPPED_GRAD_ROWS, EXPERT_QUEUE_DEPTH
from swarm.moe.server.backend import ExpertBackend
from swarm.moe.server.gradient_bounds import GradientBound
from swarm.moe.server.hostile import HostileAnswers
from swarm.moe.server.saved_graphs import SavedForward, SavedGraphs
from swarm.moe.server.task_pool import TaskPool

__all__ = ["BatchingConfig", "GraphGone", "HostedExpert"]


@dataclass(frozen=True)
class BatchingConfig:
    """How one expert's requests are merged into batches (see `swarm.moe.server.task_pool`).

    Batching is opportunistic by default (``max_wait=0``): a request that finds the compute
    thread idle runs at once, and requests that arrive while it is busy are merged into the next
    batch, so batching costs a lone caller no latency and still merges concurrent callers.

    Attributes:
        max_wait: seconds a batch waits for more requests after its first one arrives.
        min_batch_size: after `max_wait`, run only batches of at least this many rows...
        min_batch_timeout: ...unless the first request has waited this long.
        max_batch_tasks: the most requests merged into one batch; 1 disables batching.
        max_queue_rows: the most rows waiting per pool; past it requests are refused
            (ResourceExhausted). None: 16 x the expert's max batch size.
        saved_graph_rows: the most rows of forward graphs kept per expert for the backward
            that follows (0 disables; a backward then recomputes its forward).
        saved_graph_ttl: seconds a kept graph waits for its backward.
    """

    max_wait: float = 0.0
    min_batch_size: int = 1
    min_batch_timeout: float = 0.05
    max_batch_tasks: int | None = None
    max_queue_rows: int | None = None
    saved_graph_rows: int = 1024
    saved_graph_ttl: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.max_wait <= self.min_batch_timeout:
            raise ConfigError("need 0 <= max_wait <= min_batch_timeout")
        if self.min_batch_size < 1 or (self.max_batch_tasks is not None and self.max_batch_tasks < 1):
            raise ConfigError("min_batch_size and max_batch_tasks must be positive")
        if self.saved_graph_rows < 0 or not self.saved_graph_ttl > 0:
            raise ConfigError("saved_graph_rows must be >= 0 and saved_graph_ttl > 0")


class GraphGone(MoEError):
    """A backward without inputs named a forward whose graph is no longer kept; resend with inputs."""


class HostedExpert:
    """One served expert. `forward` / `backward` are awaited on the server's event loop.

    Args:
        backend: the expert.
        config: batching and graph-keeping settings.
        gradient_bound: bounds the output gradients callers send before the expert trains on them.
        hostile: a fault for tests and demos (`swarm.moe.server.hostile`): lie in every answer this way.
    """

    def __init__(
        self, backend: ExpertBackend, config: BatchingConfig, gradient_bound: GradientBound | None = None,
        hostile: str | None = None,
    ) -> None:
        self.backend = backend
        self.gradient_bound = gradient_bound
        self._hostile_forward = HostileAnswers(hostile) if hostile is not None else None
        self._hostile_backward = HostileAnswers(hostile) if hostile is not None else None
        self._clipped_metric = EXPERT_CLIPPED_GRAD_ROWS.labels(expert=backend.name)
        self.saved = SavedGraphs(min(config.saved_graph_rows, backend.max_batch_size), config.saved_graph_ttl)
        self.forward_pool = self._pool(self._forward_batch, "forward", config)
        self.backward_pool = self._pool(self._backward_batch, "backward", config)
        # A backward that relies on a kept graph carries no inputs, so it cannot join other backwards.
        self.kept_backward_pool = self._pool(self._kept_backward_batch, "backward_kept", config, alone=True)
        self._batches_metric = EXPERT_BATCHES.labels(expert=backend.name)
        EXPERT_QUEUE_DEPTH.labels(expert=backend.name).set_function(
            lambda: sum(pool.stats().queued_tasks for pool in self.pools)
        )

    def _pool(
        self, fn: Callable[..., tuple[torch.Tensor, ...]], kind: str, config: BatchingConfig, alone: bool = False
    ) -> TaskPool:
        limit = self.backend.max_batch_size
        return TaskPool(
            fn, f"{self.backend.name}.{kind}", min(config.min_batch_size, limit), limit, config.max_wait,
            config.max_queue_rows, config.min_batch_timeout, max_batch_tasks=1 if alone else config.max_batch_tasks,
            pass_tags=True, group=self,  # the pools share the parameters and the saved graphs
        )

    @property
    def pools(self) -> tuple[TaskPool, TaskPool, TaskPool]:
        return self.forward_pool, self.backward_pool, self.kept_backward_pool

    async def forward(
        self, inputs: Sequence[torch.Tensor], graph_key: Hashable | None
    ) -> tuple[tuple[torch.Tensor, ...], bool]:
        """Queues a forward; `graph_key` asks to keep its graph for the backward that follows.

        Returns:
            The outputs, and whether the graph was kept (the backward may then omit the inputs).
        """
        return self.split_forward(await self.forward_pool.submit(*inputs, tag=graph_key))

    @staticmethod
    def split_forward(result: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], bool]:
        """Splits what `forward_pool` returns for a task into (outputs, graph kept)."""
        *outputs, kept = result
        return tuple(outputs), bool(kept[0])

    async def backward(
        self, inputs_and_grads: Sequence[torch.Tensor], graph_key: Hashable | None
    ) -> tuple[torch.Tensor, ...]:
        """Queues a backward (and a training step); `graph_key` names a kept forward."""
        return await self.backward_pool.submit(*inputs_and_grads, tag=graph_key)

    async def backward_kept(self, grad_outputs: Sequence[torch.Tensor], graph_key: Hashable) -> tuple[torch.Tensor, ...]:
        """Queues a backward through the graph kept under `graph_key`, without its inputs.

        Raises:
            GraphGone: that graph is no longer kept (expired, evicted, or the expert took a step).
            InvalidRequest: the gradients do not fit that forward's outputs.
        """
        return await self.kept_backward_pool.submit(*grad_outputs, tag=graph_key)

    # ---- compute threads (one batch of this expert at a time) --------------------------------

    def _forward_batch(self, *inputs: torch.Tensor, tags: list[Hashable | None]) -> tuple[torch.Tensor, ...]:
        # The last output is a per-row flag: whether the graph was kept (split off by split_forward).
        backend = self.backend
        self._batches_metric.inc()
        rows = inputs[0].shape[0]
        key = tags[0] if len(tags) == 1 else None
        if key is None or not self.saved.accepts(rows):
            return (*self._answer(backend.forward(*inputs), self._hostile_forward), torch.zeros(rows, dtype=torch.bool))
        leaves, outputs = backend.forward_with_graph(*inputs)
        self.saved.put(key, SavedForward(leaves, outputs, backend.updates, rows, time.monotonic()))
        # Tell the caller it may leave the inputs out of its backward only while no other work waits
        # for this expert: another caller's backward would take a step first and void the graph, and
        # the backward would then travel twice (BENCHMARKS.md, "Measurements behind design choices").
        alone = not any(pool.stats().queued_tasks for pool in self.pools)
        answer = self._answer(tuple(o.detach() for o in outputs), self._hostile_forward)
        return (*answer, torch.full((rows,), alone, dtype=torch.bool))

    @staticmethod
    def _answer(tensors: tuple[torch.Tensor, ...], hostile: HostileAnswers | None) -> tuple[torch.Tensor, ...]:
        return tensors if hostile is None else hostile.corrupt(tensors)

    def _bounded(self, grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The output gradients a caller sent, rows over the expert's bound scaled down."""
        if self.gradient_bound is None:
            return tuple(grads)
        before = self.gradient_bound.clipped_rows
        bounded = self.gradient_bound.clip(grads)
        if self.gradient_bound.clipped_rows > before:
            self._clipped_metric.inc(self.gradient_bound.clipped_rows - before)
        return bounded

    def _backward_batch(self, *inputs_and_grads: torch.Tensor, tags: list[Hashable | None]) -> tuple[torch.Tensor, ...]:
        backend = self.backend
        self._batches_metric.inc()
        num_inputs = len(backend.args_schema)
        saved = None
        if len(tags) == 1 and tags[0] is not None:
            saved = self.saved.pop(tags[0])
            inputs = inputs_and_grads[:num_inputs]
            if saved is not None and not saved.matches(inputs, backend.updates):
                saved = None
            if saved is None:
                self.saved.misses += 1
        if saved is None:
            backend.validate_backward_inputs(inputs_and_grads, check_finite=False)
            grads = backend.backward(*inputs_and_grads[:num_inputs], *self._bounded(inputs_and_grads[num_inputs:]))
        else:
            self.saved.hits += 1
            backend.validate_backward_inputs(inputs_and_grads, check_finite=False)
            grads = backend.backward_through(saved.inputs, saved.outputs, self._bounded(inputs_and_grads[num_inputs:]))
        self.saved.invalidate_before(backend.updates)  # graphs from before this step can never be used
        return self._answer(grads, self._hostile_backward)

    def _kept_backward_batch(self, *grad_outputs: torch.Tensor, tags: list[Hashable | None]) -> tuple[torch.Tensor, ...]:
        backend = self.backend
        self._batches_metric.inc()
        saved = self.saved.pop(tags[0])
        if saved is None or saved.version != backend.updates:  # the resent backward counts the miss
            raise GraphGone(f"expert {backend.name}: the forward's graph is no longer kept; send the inputs")
        if grad_outputs[0].shape[0] != saved.rows:
            raise InvalidRequest(
                f"expert {backend.name}: gradients for {grad_outputs[0].shape[0]} rows, the forward had {saved.rows}"
            )
        self.saved.hits += 1
        backend.validate_grad_outputs(grad_outputs, check_finite=False)
        grads = backend.backward_through(saved.inputs, saved.outputs, self._bounded(grad_outputs))
        self.saved.invalidate_before(backend.updates)
        return self._answer(grads, self._hostile_backward)
