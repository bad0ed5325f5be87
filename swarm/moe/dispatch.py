"""A mixture's calls to its experts: one request per chosen expert per batch, all at once.

Each expert chosen by any sample gets ONE Forward carrying every row that chose it (hivemind
sends one request per sample and expert). The calls run concurrently on the peer's loop and are
awaited under the k_min policy (SPEC.md §4): a forward succeeds while every sample has at least
`k_min` experts that answered within the deadline; once that holds, stragglers get
`timeout_after_k_min` more seconds. Experts that fail are skipped for this batch (a debug log,
not an error: peers vanish) and excluded from the next searches for a few seconds. The backward
sends each expert that answered its rows' output gradients under the same policy.

`MixtureCall` ties this to autograd: its forward returns the experts' outputs per (sample, slot)
and which slots answered; its backward returns the gradient w.r.t. the mixture's input.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarm.core.errors import MoEError
from swarm.moe.beam_search import ExpertChoice
from swarm.moe.expert import as_payload, new_graph_id
from swarm.moe.protocol import call_backward, call_forward

__all__ = ["DispatchPolicy", "ExpertJob", "MixtureCall", "plan_jobs"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatchPolicy:
    """When a mixture stops waiting for its experts.

    Attributes:
        k_min: every sample needs this many experts answering its forward.
        forward_timeout: deadline of the forward calls, seconds.
        timeout_after_k_min: once every sample has k_min answers, wait at most this much longer
            for the rest (None: until `forward_timeout`).
        backward_k_min: every sample needs this many experts answering its backward (at most
            as many as answered its forward).
        backward_timeout: deadline of the backward calls, seconds.
        allow_zero_outputs: a sample short of k_min gets no expert output (zeros) instead of
            failing the batch.
        exclude_failed_for: seconds a failed expert is left out of the next searches.
    """

    k_min: int = 1
    forward_timeout: float = 30.0
    timeout_after_k_min: float | None = None
    backward_k_min: int = 1
    backward_timeout: float = 30.0
    allow_zero_outputs: bool = False
    exclude_failed_for: float = 5.0

    def __post_init__(self) -> None:
        if self.k_min < 1 or self.backward_k_min < 1:
            raise ValueError("k_min and backward_k_min must be at least 1")
        if not self.forward_timeout > 0 or not self.backward_timeout > 0:
            raise ValueError("forward_timeout and backward_timeout must be positive")
        if self.timeout_after_k_min is not None and self.timeout_after_k_min < 0:
            raise ValueError("timeout_after_k_min must be >= 0 or None")
        if self.exclude_failed_for < 0:
            raise ValueError("exclude_failed_for must be >= 0")


@dataclass(frozen=True)
class ExpertJob:
    """One expert's share of a batch: which (sample, slot) pairs chose it."""

    uid: str
    addr: str
    rows: torch.Tensor
    slots: torch.Tensor
    graph_id: int | None


def plan_jobs(choice: ExpertChoice, keep_graphs: bool) -> list[ExpertJob]:
    """Groups the chosen (sample, slot) pairs by expert: one job, hence one request, per expert."""
    codes = choice.codes.masked_fill(~choice.valid, -1)
    jobs = []
    for code, (uid, addr) in sorted(choice.experts.items()):
        rows, slots = (codes == code).nonzero(as_tuple=True)
        if rows.numel():
            jobs.append(ExpertJob(uid, addr, rows, slots, new_graph_id() if keep_graphs else None))
    return jobs


OnFailure = Callable[[ExpertJob, BaseException], None]


async def _gather_with_k_min(
    calls: Sequence[Awaitable[list[torch.Tensor]]],
    jobs: Sequence[ExpertJob],
    batch: int,
    needed: torch.Tensor,
    timeout: float,
    after_k_min: float | None,
    on_failure: OnFailure,
) -> list[list[torch.Tensor] | None]:
    """Runs the calls concurrently; returns each one's result, or None if it failed or was too late."""
    loop = asyncio.get_running_loop()
    tasks = {asyncio.ensure_future(c): i for i, c in enumerate(calls)}
    results: list[list[torch.Tensor] | None] = [None] * len(jobs)
    answered = torch.zeros(batch, dtype=torch.long)
    deadline = loop.time() + timeout
    k_min_at: float | None = None
    pending = set(tasks)
    try:
        while pending:
            until = deadline if k_min_at is None or after_k_min is None else min(deadline, k_min_at + after_k_min)
            left = until - loop.time()
            if left <= 0:
                break
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = tasks[task]
                if task.exception() is not None:
                    on_failure(jobs[i], task.exception())  # type: ignore[arg-type]
                else:
                    results[i] = task.result()
                    answered[jobs[i].rows] += 1
            if k_min_at is None and bool((answered >= needed).all()):
                k_min_at = loop.time()
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    for task in pending:
        on_failure(jobs[tasks[task]], TimeoutError("no answer before the mixture stopped waiting"))
    return results


class MixtureCall(torch.autograd.Function):
    """Autograd bridge: ``apply(dummy, caller, choice, x, keep_graphs)`` -> (outputs, answered).

    `caller` is a `MixtureCaller` (peer, policy, output shape, failure hook).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, dummy: torch.Tensor, caller: MixtureCaller, choice: ExpertChoice, x: torch.Tensor, keep_graphs: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        jobs = plan_jobs(choice, keep_graphs)
        outputs, answered, results = caller.forward(jobs, x, choice)
        ctx.caller, ctx.jobs = caller, [job for job, result in zip(jobs, results) if result is not None]
        ctx.forward_answers = answered.sum(dim=1)
        ctx.save_for_backward(x)
        ctx.mark_non_differentiable(answered)
        return outputs, answered

    @staticmethod
    def backward(ctx: Any, grad_outputs: torch.Tensor, _grad_answered: Any) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        grad_x = ctx.caller.backward(ctx.jobs, x, grad_outputs, ctx.forward_answers)
        return None, None, None, grad_x, None


class MixtureCaller:
    """Runs a mixture's expert calls through the peer's loop under a `DispatchPolicy`.

    Args:
        peer: the calling peer.
        policy: k_min and timeouts.
        on_failure: told about each expert that failed (the mixture excludes it for a while).
    """

    def __init__(self, peer: Any, policy: DispatchPolicy, on_failure: OnFailure) -> None:
        self.peer = peer
        self.policy = policy
        self.on_failure = on_failure
        self.output_shape: tuple[int, ...] | None = None
        """Shape of one sample's expert output, learned from the first answer."""
        self.output_dtype = torch.float32
        self.failures = 0
        """Expert calls that failed or came too late so far (each one skipped for its batch)."""

    def _failed(self, job: ExpertJob, error: BaseException) -> None:
        logger.debug("expert %s at %s failed for this batch: %s", job.uid, job.addr, error)
        self.failures += 1
        self.on_failure(job, error)

    def forward(
        self, jobs: list[ExpertJob], x: torch.Tensor, choice: ExpertChoice
    ) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor] | None]]:
        policy = self.policy
        batch, k = choice.codes.shape
        needed = torch.full((batch,), policy.k_min, dtype=torch.long)
        payload = as_payload(x)
        inputs = [payload[job.rows] for job in jobs]  # here, not on the event loop (see schema._all_finite)

        async def run() -> list[list[torch.Tensor] | None]:
            calls = [
                call_forward(self.peer.pool.get(job.addr), job.uid, [x_job], graph_id=job.graph_id,
                             timeout=policy.forward_timeout)
                for job, x_job in zip(jobs, inputs)
            ]
            return await _gather_with_k_min(calls, jobs, batch, needed, policy.forward_timeout,
                                            policy.timeout_after_k_min, self._failed)

        results = self.peer.run(run(), policy.forward_timeout + 5.0)
        for i, (job, result) in enumerate(zip(jobs, results)):
            if result is not None and not self._well_formed(result, job):
                self._failed(job, MoEError(f"expert {job.uid} answered with malformed outputs"))
                results[i] = None
        if self.output_shape is None:
            raise MoEError(f"none of the {len(jobs)} chosen experts answered, and none ever has")
        answered = torch.zeros(batch, k, dtype=torch.bool)
        outputs = torch.zeros(batch, k, *self.output_shape, dtype=self.output_dtype)
        for job, result in zip(jobs, results):
            if result is not None:
                outputs[job.rows, job.slots] = result[0].to(self.output_dtype)
                answered[job.rows, job.slots] = True
        counts = answered.sum(dim=1)
        short = counts < policy.k_min
        if bool(short.any()) and not (policy.allow_zero_outputs and bool((counts[short] == 0).all())):
            worst = int(counts.min())
            raise MoEError(
                f"only {worst} of the chosen experts answered for some samples, fewer than k_min={policy.k_min} "
                f"({sum(r is not None for r in results)} of {len(jobs)} experts answered; "
                f"{int(choice.valid.sum(dim=1).min())} live experts found for the worst sample)"
            )
        return outputs.to(x.device), answered.to(x.device), results

    def _well_formed(self, result: list[torch.Tensor], job: ExpertJob) -> bool:
        if len(result) != 1 or result[0].dim() < 1 or result[0].shape[0] != job.rows.numel():
            return False
        if not result[0].is_floating_point():
            return False
        shape = tuple(result[0].shape[1:])
        if self.output_shape is None:
            self.output_shape, self.output_dtype = shape, result[0].dtype
        return shape == self.output_shape

    def backward(
        self, jobs: list[ExpertJob], x: torch.Tensor, grad_outputs: torch.Tensor, forward_answers: torch.Tensor
    ) -> torch.Tensor:
        policy = self.policy
        batch = x.shape[0]
        needed = torch.clamp(forward_answers, max=policy.backward_k_min)
        payload, grads = as_payload(x), as_payload(grad_outputs)
        pieces = [(payload[job.rows], grads[job.rows, job.slots]) for job in jobs]

        async def run() -> list[list[torch.Tensor] | None]:
            calls = [
                call_backward(self.peer.pool.get(job.addr), job.uid, [x_job], [g_job], graph_id=job.graph_id,
                              timeout=policy.backward_timeout)
                for job, (x_job, g_job) in zip(jobs, pieces)
            ]
            return await _gather_with_k_min(calls, jobs, batch, needed, policy.backward_timeout,
                                            policy.timeout_after_k_min, self._failed)

        results = self.peer.run(run(), policy.backward_timeout + 5.0)
        grad_x = torch.zeros_like(payload)
        answered = torch.zeros(batch, dtype=torch.long)
        for job, result in zip(jobs, results):
            if result is not None and len(result) == 1 and result[0].shape == (job.rows.numel(), *x.shape[1:]):
                grad_x.index_add_(0, job.rows, result[0].to(grad_x.dtype))
                answered[job.rows] += 1
        short = answered < needed
        if bool(short.any()):
            raise MoEError(
                f"backward: only {int(answered[short].min())} experts answered for some samples, fewer than "
                f"backward_k_min={policy.backward_k_min} ({sum(r is not None for r in results)} of {len(jobs)} "
                f"experts answered)"
            )
        return grad_x.to(x.device)
