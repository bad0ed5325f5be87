"""A mixture's calls to its experts: one group call per server per batch, all at once.

Each expert chosen by any sample gets one job carrying every row that chose it, and the jobs of
one server travel in one group call (`swarm.moe.client.jobs`, `swarm.moe.group_calls`): the rows are
sent once, the server computes its experts side by side and answers each as it finishes. The
calls run concurrently on the peer's loop and are awaited under the k_min policy (docs/architecture.md, "Life of a mixture forward"): a
forward succeeds while every sample has at least `k_min` experts that answered within the
deadline; once that holds, stragglers get `timeout_after_k_min` more seconds. Experts that fail
are skipped for this batch (a debug log, not an error: peers vanish) and excluded from the next
searches for a few seconds. The backward sends each expert that answered its rows' output
gradients under the same policy, and gets back the input gradients summed per server.

Row gathers and scatters run with numpy on the calling thread (`swarm.moe.rows`): torch's thread
pool, on a 2-core machine shared with the servers, made them cost milliseconds each.

Every answer is checked before it is used, forward and backward (`swarm.moe.client.answer_checks`):
an answer of another shape, with NaN/Inf, or far larger than the layer's other answers fails its
expert for the batch like a timeout, and its server is avoided for a while; what is accepted is
clipped row by row to a bound learned from the answers, so that no expert weighs more than that in
the combination. With spot checks on, a sampled batch also asks a second server of each expert that
has one, beside its own calls, and compares; the mismatches' third opinions are asked all at once,
under one short deadline (`swarm.moe.client.spot_checks`).

`MixtureCall` ties this to autograd: its forward returns the experts' outputs per (sample, slot)
and which slots answered; its backward returns the gradient w.r.t. the mixture's input.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import swarm.moe.rows as row_ops
from swarm.core.errors import ConfigError, MoEError, RPCError
from swarm.core.status import PeerStatus
from swarm.dht.handle import PeerHandle
from swarm.moe.client.answer_checks import (
    AnswerChecks,
    AnswerGuard,
    MisbehavingExpert,
    count_event,
    input_scale,
)
from swarm.moe.client.beam_search import ExpertChoice
from swarm.moe.client.expert import as_payload
from swarm.moe.client.jobs import ExpertJob, ServerShare, plan_jobs, plan_shares
from swarm.moe.client.spot_checks import (
    ReplicaMismatch,
    SecondOpinion,
    SecondOpinions,
    SilentReplica,
    SpotChecker,
    ThirdOpinion,
)
from swarm.moe.group_calls import GroupMember, call_backward_group, call_forward_group
from swarm.moe.magnitudes import row_norms

__all__ = ["DispatchPolicy", "MixtureCall"]

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
            raise ConfigError("k_min and backward_k_min must be at least 1")
        if not self.forward_timeout > 0 or not self.backward_timeout > 0:
            raise ConfigError("forward_timeout and backward_timeout must be positive")
        if self.timeout_after_k_min is not None and self.timeout_after_k_min < 0:
            raise ConfigError("timeout_after_k_min must be >= 0 or None")
        if self.exclude_failed_for < 0:
            raise ConfigError("exclude_failed_for must be >= 0")


OnFailure = Callable[[ExpertJob, BaseException], None]


class _Answers:
    """Which jobs of a batch answered, and the k_min rule over them (used on the peer's loop)."""

    def __init__(self, jobs: Sequence[ExpertJob], batch: int, needed: torch.Tensor, on_failure: OnFailure) -> None:
        self.jobs = jobs
        self.needed = needed
        self.on_failure = on_failure
        self.results: list[list[torch.Tensor] | None] = [None] * len(jobs)
        self.answered = torch.zeros(batch, dtype=torch.long)
        self._open = set(range(len(jobs)))
        self._changed = asyncio.Event()

    def ok(self, j: int, result: list[torch.Tensor]) -> None:
        if j in self._open:
            self._open.discard(j)
            self.results[j] = result
            self.answered[self.jobs[j].rows] += 1
            self._changed.set()

    def fail(self, j: int, error: BaseException) -> None:
        if j in self._open:
            self._open.discard(j)
            self.on_failure(self.jobs[j], error)
            self._changed.set()

    def retract(self, j: int, error: BaseException) -> None:
        """An answer taken with `ok` turned out bad (after the calls): the job failed after all."""
        if self.results[j] is not None:
            self.results[j] = None
            self.answered[self.jobs[j].rows] -= 1
            self.on_failure(self.jobs[j], error)

    async def gather(
        self, calls: Sequence[Coroutine[Any, Any, None]], shares: Sequence[ServerShare], timeout: float,
        after_k_min: float | None,
    ) -> None:
        """Runs the calls concurrently until every job answered or failed, or the policy stops waiting;
        jobs without an answer then fail."""

        async def guarded(call: Coroutine[Any, Any, None], share: ServerShare) -> None:
            try:
                await call
                error: BaseException = MoEError("the server's answer left this expert out")
            except Exception as e:  # noqa: BLE001 - any failure of the call fails its open jobs
                error = e
            for j in share.jobs:
                self.fail(j, error)

        loop = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(guarded(c, s)) for c, s in zip(calls, shares)]
        deadline = loop.time() + timeout
        k_min_at: float | None = None
        try:
            while self._open:
                if k_min_at is None and bool((self.answered >= self.needed).all()):
                    k_min_at = loop.time()
                until = deadline if k_min_at is None or after_k_min is None else min(deadline, k_min_at + after_k_min)
                left = until - loop.time()
                if left <= 0:
                    break
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for j in list(self._open):
            self.fail(j, TimeoutError("no answer before the mixture stopped waiting"))


class MixtureCall(torch.autograd.Function):
    """Autograd bridge: ``apply(dummy, caller, choice, x, keep_graphs)`` -> (outputs, answered).

    `caller` is a `MixtureCaller` (peer, policy, output shape, failure hook).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, dummy: torch.Tensor, caller: MixtureCaller, choice: ExpertChoice, x: torch.Tensor, keep_graphs: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        jobs = plan_jobs(choice, keep_graphs)
        outputs, answered, results, scales = caller.forward(jobs, x, choice)
        ctx.caller, ctx.jobs = caller, [job for job, result in zip(jobs, results) if result is not None]
        ctx.scales = scales
        ctx.forward_answers = answered.sum(dim=1)
        ctx.save_for_backward(x)
        ctx.mark_non_differentiable(answered)
        return outputs, answered

    @staticmethod
    def backward(ctx: Any, grad_outputs: torch.Tensor, _grad_answered: Any) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        if ctx.scales is not None:  # a clipped output row passes its gradient on scaled alike
            grad_outputs = grad_outputs * ctx.scales.to(grad_outputs.device).view(
                *ctx.scales.shape, *([1] * (grad_outputs.dim() - 2)))
        grad_x = ctx.caller.backward(ctx.jobs, x, grad_outputs, ctx.forward_answers)
        return None, None, None, grad_x, None


class MixtureCaller:
    """Runs a mixture's expert calls through the peer's loop under a `DispatchPolicy`.

    Args:
        peer: the calling peer.
        policy: k_min and timeouts.
        on_failure: told about each expert that failed (the mixture excludes it for a while).
        checks: how answers are checked and clipped (default: `AnswerChecks()`).
        spot: compares a sampled fraction of the answers with other servers' (None: never). A
            mismatch that blames the other server is told to `on_failure` with the job it checked,
            whose answer stands (`ReplicaMismatch.blamed` names the server); so is a server asked
            for a second or third opinion that gave none in time (`SilentReplica.addr`). A mismatch
            that blames nobody leaves the answer as it is.
    """

    def __init__(
        self, peer: PeerHandle, policy: DispatchPolicy, on_failure: OnFailure, checks: AnswerChecks | None = None,
        spot: SpotChecker | None = None,
    ) -> None:
        self.peer = peer
        self.policy = policy
        self.on_failure = on_failure
        self.checks = checks or AnswerChecks()
        self.spot = spot
        self.guard = AnswerGuard(self.checks)
        self.output_shape: tuple[int, ...] | None = None
        """Shape of one sample's expert output, learned from the first answer."""
        self.output_dtype = torch.float32
        self.failures = 0
        """Expert calls that failed or came too late so far (each one skipped for its batch)."""
        self.misbehaviours = 0
        """Answers rejected by the checks so far, forward and backward (each also counts in `failures`)."""

    def _failed(self, job: ExpertJob, error: BaseException) -> None:
        if isinstance(error, ReplicaMismatch):
            pass  # logged by the spot checker, which knows what was done
        elif isinstance(error, MisbehavingExpert):
            logger.warning("%s: skipped for this batch, its server avoided for %.0f s", error, self.checks.avoid_for)
        else:
            logger.debug("expert %s at %s failed for this batch: %s", job.uid, job.addr, error)
        self.failures += 1
        self.on_failure(job, error)

    def _rejected(self, direction: str, reason: str, job: ExpertJob, what: str) -> MisbehavingExpert:
        count_event("rejected", direction, reason)
        PeerStatus.of(self.peer).answer_rejected(job.addr)  # the peer's Info answer names the server
        self.misbehaviours += 1
        return MisbehavingExpert(f"expert {job.uid} at {job.addr}: {what}", reason)

    @staticmethod
    def _members(jobs: Sequence[ExpertJob], share: ServerShare) -> list[GroupMember]:
        return [GroupMember(jobs[j].uid, jobs[j].graph_id, rows) for j, rows in zip(share.jobs, share.member_rows)]

    def forward(
        self, jobs: list[ExpertJob], x: torch.Tensor, choice: ExpertChoice
    ) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor] | None], torch.Tensor | None]:
        policy = self.policy
        batch, k = choice.codes.shape
        payload = as_payload(x)
        shares = plan_shares(jobs, batch)
        inputs = [payload if s.rows is None else row_ops.take_rows(payload, s.rows) for s in shares]
        answers = _Answers(jobs, batch, torch.full((batch,), policy.k_min, dtype=torch.long), self._failed)
        spot = self.spot if self.spot is not None and self.spot.sample() else None
        job_rows = [row_ops.take_rows(payload, job.rows) for job in jobs] if spot is not None else []
        opinions = SecondOpinions()

        async def call(share: ServerShare, x_share: torch.Tensor) -> None:
            def on_answer(i: int, outcome: list[torch.Tensor] | RPCError) -> None:
                if isinstance(outcome, RPCError):
                    answers.fail(share.jobs[i], outcome)
                else:
                    answers.ok(share.jobs[i], outcome)

            await call_forward_group(self.peer.pool.get(share.addr), self._members(jobs, share), [x_share], on_answer,
                                     timeout=policy.forward_timeout)

        async def second_opinions(checker: SpotChecker) -> None:
            try:
                await checker.second_opinions([(job.uid, job.addr) for job in jobs], job_rows, opinions)
            except Exception as e:  # noqa: BLE001 - a spot check that cannot be made gives no evidence
                logger.debug("no spot check for this batch: %s", e)

        async def run() -> None:
            calls = answers.gather([call(s, xs) for s, xs in zip(shares, inputs)], shares, policy.forward_timeout,
                                   policy.timeout_after_k_min)
            if spot is None:
                await calls
                return
            # the second opinions travel beside the batch's own calls, and once those are done get at
            # most `opinion_timeout` more: a silent second server holds the batch no longer than that
            asking = asyncio.ensure_future(second_opinions(spot))
            try:
                await calls
                await asyncio.wait([asking], timeout=spot.opinion_timeout)
            finally:
                asking.cancel()
                await asyncio.gather(asking, return_exceptions=True)

        self.peer.run(run(), policy.forward_timeout + (spot.opinion_timeout if spot is not None else 0.0) + 5.0)
        for j, addr in opinions.unanswered():  # like a timeout: that server is avoided a while
            self.on_failure(jobs[j], SilentReplica(f"expert {jobs[j].uid}: its server {addr} gave no second "
                                                   f"opinion in time", addr))
        results = answers.results
        self._learn_output_shape(results, tuple(x.shape[1:]))
        for i, (job, result) in enumerate(zip(jobs, results)):
            if result is not None and not self._well_formed(result, job):
                self._failed(job, self._rejected("forward", "shape", job, "answered outputs of another shape"))
                results[i] = None
        reference = None
        if self.checks.enabled:
            x_scale = input_scale(payload)
            formed = [i for i, r in enumerate(results) if r is not None]
            verdict = self.guard.judge([results[i][0] for i in formed],  # type: ignore[index]
                                       [x_scale[jobs[i].rows] for i in formed], self.guard.outputs)
            reference = verdict.reference
            slot_norms = torch.zeros(batch, k)
            for i, reason, norms in zip(formed, verdict.rejected, verdict.norms):
                if reason is None:
                    slot_norms[jobs[i].rows, jobs[i].slots] = norms
                else:
                    what = "answered NaN/Inf" if reason == "not_finite" else (
                        f"answered outputs over {self.checks.reject_ratio:g}x the layer's reference {verdict.reference:.3g}")
                    self._failed(jobs[i], self._rejected("forward", reason, jobs[i], what))
                    results[i] = None
        if spot is not None:
            self._spot_check(spot, jobs, results, opinions.found, job_rows)
        if self.output_shape is None:
            raise MoEError(f"none of the {len(jobs)} chosen experts answered, and none ever has")
        answered = torch.zeros(batch, k, dtype=torch.bool)
        outputs = row_ops.zeros((batch, k, *self.output_shape), self.output_dtype)
        for job, result in zip(jobs, results):
            if result is not None:
                row_ops.put_pairs_(outputs, job.rows, job.slots, result[0])
                answered[job.rows, job.slots] = True
        scales = None
        if self.checks.enabled:
            scales = self.guard.clip_scales(slot_norms, x_scale.unsqueeze(1).expand(batch, k), reference)
            if scales is not None:
                count_event("clipped", "forward", rows=int((scales < 1).sum()))
                outputs.mul_(scales.view(batch, k, *([1] * (outputs.dim() - 2))).to(outputs.dtype))
        counts = answered.sum(dim=1)
        short = counts < policy.k_min
        if bool(short.any()) and not (policy.allow_zero_outputs and bool((counts[short] == 0).all())):
            worst = int(counts.min())
            raise MoEError(
                f"only {worst} of the chosen experts answered for some samples, fewer than k_min={policy.k_min} "
                f"({sum(r is not None for r in results)} of {len(jobs)} experts answered; "
                f"{int(choice.valid.sum(dim=1).min())} live experts found for the worst sample)"
            )
        return outputs.to(x.device), answered.to(x.device), results, scales

    def _spot_check(
        self, spot: SpotChecker, jobs: Sequence[ExpertJob], results: list[list[torch.Tensor] | None],
        opinions: Sequence[SecondOpinion], job_rows: Sequence[torch.Tensor],
    ) -> None:
        """Compares the accepted answers with their second opinions, asks the third opinions of all the
        mismatches at once, and drops the answers of servers shown wrong."""
        mismatched = [o for o in opinions if (r := results[o.job]) is not None and not spot.matches(r[0], o)]
        asks = [o for o in mismatched if spot.needs_third(results[o.job][0], o)]  # type: ignore[index]
        thirds: dict[int, ThirdOpinion | None] = {}
        if asks:
            requests = [(jobs[o.job].uid, (jobs[o.job].addr, o.addr), job_rows[o.job]) for o in asks]
            try:
                found = self.peer.run(spot.third_opinions(requests), spot.opinion_timeout + 5.0)
            except Exception as e:  # noqa: BLE001 - no third opinion: the mismatches stay undecided
                logger.debug("no third opinions for this batch: %s", e)
                found = [None] * len(asks)
            thirds = {o.job: third for o, third in zip(asks, found)}
        for opinion in mismatched:
            job, result, third = jobs[opinion.job], results[opinion.job], thirds.get(opinion.job)
            if third is not None and third.outputs is None:  # like a timeout: that server is avoided a while
                self.on_failure(job, SilentReplica(f"expert {job.uid}: its server {third.addr} gave no third "
                                                   f"opinion within {spot.opinion_timeout:.3g} s", third.addr))
            error = spot.judge(job.uid, job.addr, result[0], opinion, third)  # type: ignore[index]
            if error.blamed is None:
                continue  # nothing tells which one lies: the answer, which passed the checks, stands
            self.misbehaviours += 1
            if error.blamed == opinion.addr:
                self.on_failure(job, error)  # the other server lied: it is avoided, this answer stands
            else:
                self._failed(job, error)
                results[opinion.job] = None

    def _learn_output_shape(self, results: Sequence[list[torch.Tensor] | None], input_shape: tuple[int, ...]) -> None:
        """Takes the layer's output shape from its first answers: the most common one (a tie goes to
        the input's shape, then to the first), so that a lone liar answering first cannot set it."""
        if self.output_shape is not None:
            return
        votes: dict[tuple[tuple[int, ...], torch.dtype], int] = {}
        for result in results:
            if result is not None and len(result) == 1 and result[0].dim() >= 1 and result[0].is_floating_point():
                key = (tuple(result[0].shape[1:]), result[0].dtype)
                votes[key] = votes.get(key, 0) + 1
        if votes:
            best = max(votes.items(), key=lambda kv: (kv[1], kv[0][0] == input_shape))[0]
            self.output_shape, self.output_dtype = best

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
        payload, grads = as_payload(x), as_payload(grad_outputs)
        shares = plan_shares(jobs, batch)
        inputs = [payload if s.rows is None else row_ops.take_rows(payload, s.rows) for s in shares]
        job_grads = [row_ops.take_pairs(grads, job.rows, job.slots) for job in jobs]
        needed = torch.clamp(forward_answers, max=policy.backward_k_min)
        answers = _Answers(jobs, batch, needed, self._failed)
        sums: list[torch.Tensor | None] = [None] * len(shares)
        taken: list[list[int]] = [[] for _ in shares]

        async def call(s: int, share: ServerShare, x_share: torch.Tensor) -> None:
            answered, summed = await call_backward_group(
                self.peer.pool.get(share.addr), self._members(jobs, share), [x_share],
                [[job_grads[j]] for j in share.jobs], lambda i, e: answers.fail(share.jobs[i], e),
                timeout=policy.backward_timeout,
            )
            if answered:
                if len(summed) != 1 or summed[0].shape != x_share.shape or summed[0].dtype != x_share.dtype:
                    first = jobs[share.jobs[0]]
                    raise self._rejected("backward", "shape", first, f"answered gradients of another shape "
                                         f"(its server's share: {len(share.jobs)} experts)")
                sums[s] = summed[0]
            for i in answered:
                taken[s].append(share.jobs[i])
                answers.ok(share.jobs[i], [])

        async def run() -> None:
            await answers.gather([call(s, share, xs) for s, (share, xs) in enumerate(zip(shares, inputs))], shares,
                                 policy.backward_timeout, policy.timeout_after_k_min)

        self.peer.run(run(), policy.backward_timeout + 5.0)
        if self.checks.enabled:
            self._check_gradients(jobs, job_grads, shares, sums, taken, answers)
        grad_x = row_ops.zeros(tuple(payload.shape), payload.dtype)
        for share, summed in zip(shares, sums):
            if summed is not None:
                if share.rows is None:
                    row_ops.add_(grad_x, summed)
                else:
                    row_ops.add_rows_(grad_x, share.rows, summed)
        short = answers.answered < needed
        if bool(short.any()):
            raise MoEError(
                f"backward: only {int(answers.answered[short].min())} experts answered for some samples, fewer "
                f"than backward_k_min={policy.backward_k_min} ({sum(r is not None for r in answers.results)} of "
                f"{len(jobs)} experts answered)"
            )
        return grad_x.to(x.device)

    def _check_gradients(
        self, jobs: Sequence[ExpertJob], job_grads: Sequence[torch.Tensor], shares: Sequence[ServerShare],
        sums: list[torch.Tensor | None], taken: Sequence[Sequence[int]], answers: _Answers,
    ) -> None:
        """Judges each server's summed input gradients (as gains over the output gradients it was
        sent), drops the rejected ones and clips the rows of the others, in place."""
        answered = [s for s, summed in enumerate(sums) if summed is not None]
        if not answered:
            return
        sent = [_sent_norms(job_grads, shares[s], taken[s], sums[s].shape[0]) for s in answered]  # type: ignore[union-attr]
        verdict = self.guard.judge([sums[s] for s in answered], sent, self.guard.grads)  # type: ignore[misc]
        for s, sent_norms, reason, norms in zip(answered, sent, verdict.rejected, verdict.norms):
            summed = sums[s]
            if summed is None:
                continue
            if reason is not None:
                sums[s] = None
                for j in taken[s]:
                    what = "answered NaN/Inf gradients" if reason == "not_finite" else (
                        f"answered gradients over {self.checks.reject_ratio:g}x the layer's reference "
                        f"{verdict.reference:.3g}")
                    answers.retract(j, self._rejected("backward", reason, jobs[j], what))
                continue
            scales = self.guard.clip_scales(norms, sent_norms, verdict.reference)
            if scales is not None:
                count_event("clipped", "backward", rows=int((scales < 1).sum()))
                sums[s] = summed * scales.view(-1, *([1] * (summed.dim() - 1))).to(summed.dtype)


def _sent_norms(job_grads: Sequence[torch.Tensor], share: ServerShare, taken: Sequence[int], rows: int) -> torch.Tensor:
    """Per row of a server's share, the summed norms of the output gradients sent to its answered experts."""
    sums = torch.zeros(rows)
    member_rows = dict(zip(share.jobs, share.member_rows))
    for j in taken:
        norms, index = row_norms(job_grads[j]), member_rows[j]
        if index is None:
            sums += norms
        else:
            sums.index_add_(0, index, norms)
    return sums

