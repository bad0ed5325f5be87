"""The expert server's side of group calls (`swarm.moe.group_calls`): several experts per stream.

A group request is admitted and checked like a single-expert one (`swarm.moe.server.admission`): one
request slot, every declared tensor held against the schemas of the experts it goes to and its
bytes reserved before any is read, the received inputs checked in full (NaN/Inf). What concerns
one expert only fails that expert, in its own response bundle: it is not hosted (forward), its
output gradients hold NaN/Inf, its queue is full, its module raised. Every expert's task is queued
at once (`Runtime.submit_together`), so the compute workers split them from the start; forward
outputs go back as each expert finishes, backward input gradients once, summed over the experts.
Row gathers and sums run on the event loop with numpy (`swarm.moe.rows`), never on torch's
thread pool, which the compute threads use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

import swarm.moe.rows as row_ops
from swarm.core.errors import DeadlineExceeded, InvalidRequest, NotFound, PeerUnreachable, SwarmError
from swarm.dht.handle import PeerHandle
from swarm.moe.group_calls import GroupRequest, error_metadata, parse_group_header
from swarm.moe.protocol import shown_uid
from swarm.moe.server.admission import check_declared_batch, drain_request, receive_header
from swarm.moe.server.hosted import HostedExpert
from swarm.net.server import CallContext
from swarm.net.streaming import TensorReceiver, tensors_to_messages

if TYPE_CHECKING:
    from swarm.moe.server.admission import Admission
    from swarm.moe.server.config import ExpertServerConfig
    from swarm.moe.server.runtime import Runtime

__all__ = ["GroupCallHandlers"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class _Member:
    index: int
    uid: str
    hosted: HostedExpert | None
    key: Hashable | None
    rows: torch.Tensor | None


@dataclass(frozen=True)
class _Received:
    members: list[_Member]
    inputs: list[torch.Tensor]
    grads: list[list[torch.Tensor]]
    refused: dict[int, SwarmError]


class GroupCallHandlers:
    """The ForwardGroup and BackwardGroup handlers of `swarm.moe.server.expert_server.ExpertServer` (a mixin)."""

    peer: PeerHandle
    config: ExpertServerConfig
    experts: dict[str, HostedExpert]
    admission: Admission
    runtime: Runtime
    _closing: bool

    async def rpc_forward_group(self, requests: AsyncIterator[bytes], ctx: CallContext) -> AsyncIterator[bytes]:
        """ForwardGroup: shared inputs in; each expert's outputs out, in the order they finish."""
        async with self._group_request(requests, ctx, backward=False) as received:
            for message in _refusals(received):
                yield message
            members = [m for m in received.members if m.index not in received.refused]
            futures = self.runtime.submit_together(
                [(m.hosted.forward_pool, _share(received.inputs, m.rows), m.key) for m in members]  # type: ignore[union-attr]
            )
            outputs: tuple[torch.Tensor, ...]
            async with contextlib.aclosing(_each_completed(members, futures)) as completed:
                async for member, outcome in completed:
                    if isinstance(outcome, SwarmError):
                        outputs, metadata = (), error_metadata(member.index, outcome)
                    else:
                        outputs, metadata = HostedExpert.split_forward(outcome)[0], {"expert": member.index}
                    for message in tensors_to_messages(outputs, metadata):
                        yield message

    async def rpc_backward_group(self, requests: AsyncIterator[bytes], ctx: CallContext) -> AsyncIterator[bytes]:
        """BackwardGroup: shared inputs and each expert's output gradients in; the input gradients
        summed over the experts out; each expert takes a training step."""
        async with self._group_request(requests, ctx, backward=True) as received:
            for message in _refusals(received):
                yield message
            members = [m for m in received.members if m.index not in received.refused]
            futures = self.runtime.submit_together([
                (m.hosted.backward_pool, [*_share(received.inputs, m.rows), *received.grads[m.index]], m.key)  # type: ignore[union-attr]
                for m in members
            ])
            sums = _GradientSum(received.inputs)
            async with contextlib.aclosing(_each_completed(members, futures)) as completed:
                async for member, outcome in completed:
                    if isinstance(outcome, SwarmError):
                        for message in tensors_to_messages([], error_metadata(member.index, outcome)):
                            yield message
                    else:
                        sums.add(member, outcome)
            for message in tensors_to_messages(sums.totals or [], {"experts": sorted(sums.answered)}):
                yield message

    # ---- receiving --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _admitted(
        self, requests: AsyncIterator[bytes], receive: Callable[[AsyncIterator[bytes], contextlib.AsyncExitStack],
                                                              Awaitable[_T]],
    ) -> AsyncIterator[_T]:
        """Runs `receive(stream, held)` (admit one request, receive and check its tensors) and holds
        what it took (queue slot, bytes) in `held` until exit."""
        stream = aiter(requests)
        async with contextlib.AsyncExitStack() as held:
            try:
                received = await receive(stream, held)
            except DeadlineExceeded:
                raise  # the caller stalled: nothing to drain, refuse at once
            except SwarmError:
                # Read what the caller still sends before refusing: a call that ends while the caller
                # is still writing reaches it as INTERNAL instead of the status that says why.
                await drain_request(stream, self.config.max_drain_bytes, self.config.max_drain_seconds)
                raise
            yield received

    async def _receive_tensors(self, stream: AsyncIterator[bytes], header_bytes: bytes, nbytes: int, what: str,
                               held: contextlib.AsyncExitStack) -> list[torch.Tensor]:
        """Reserves `nbytes` of the admission budget (held until `held` exits) and receives the
        request's tensors into it; a stream that ends early or says more than it declared is refused."""
        held.enter_context(self.admission.reserve(nbytes, what))
        receiver = TensorReceiver(header_bytes, max_bytes=nbytes)
        cfg = self.config
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + cfg.body_timeout
        received = 0
        while not receiver.complete:
            # the bytes received so far pay for waiting until `paid`: the grace plus their worth at the minimum rate
            paid = start + cfg.body_grace + received / cfg.min_body_rate
            try:
                async with asyncio.timeout_at(min(deadline, paid)):
                    chunk = await anext(stream, None)
            except TimeoutError:
                if paid < deadline:
                    self.admission.too_slow += 1
                    raise DeadlineExceeded(
                        f"{what}: the request's tensors arrive too slowly ({received} of {nbytes} bytes in "
                        f"{loop.time() - start:.3g} s; at least {cfg.min_body_rate:g} bytes/s are required after "
                        f"{cfg.body_grace:g} s)") from None
                raise DeadlineExceeded(
                    f"{what}: the request's tensors did not arrive within {cfg.body_timeout:g} s") from None
            if chunk is None:
                break
            received += len(chunk)
            receiver.feed(chunk)
        return receiver.result()

    def _group_request(
        self, requests: AsyncIterator[bytes], ctx: CallContext, backward: bool
    ) -> contextlib.AbstractAsyncContextManager[_Received]:
        """Admits one group request; yields its `_Received`."""
        return self._admitted(requests, lambda stream, held: self._receive_group(stream, ctx, backward, held))

    async def _receive_group(
        self, stream: AsyncIterator[bytes], ctx: CallContext, backward: bool, held: contextlib.AsyncExitStack
    ) -> _Received:
        what = "backward group" if backward else "forward group"
        header_bytes = await receive_header(stream, self.config.header_timeout, what)
        request = parse_group_header(header_bytes)
        held.enter_context(self.admission.request(what, ctx.peer_id or "", ctx.source))
        if self._closing:
            raise PeerUnreachable(f"expert server {self.peer.peer_id} is shutting down")
        hosted, refused = self._resolve(request, what, backward)
        nbytes = self._check_layout(request, hosted, what, backward)
        tensors = await self._receive_tensors(stream, header_bytes, nbytes, what, held)
        first = next(h for h in hosted if h is not None).backend
        inputs = tensors[: request.num_inputs]
        first.validate_forward_inputs(inputs, check_finite=self.config.check_finite)
        batch = inputs[0].shape[0]
        grads: list[list[torch.Tensor]] = []
        offset = request.num_inputs
        num_grads = sum(len(h.backend.outputs_schema) for h in hosted if h is not None) if backward else 0
        row_tensors = iter(tensors[offset + num_grads :])
        members = []
        for i, ((uid, graph_id, has_rows), h) in enumerate(zip(request.members, hosted)):
            rows = _checked_rows(next(row_tensors), batch, uid, what) if has_rows else None
            if backward and h is not None:
                count = len(h.backend.outputs_schema)
                grads.append(tensors[offset : offset + count])
                offset += count
                if self.config.check_finite:
                    try:
                        for j, (g, schema) in enumerate(zip(grads[-1], h.backend.outputs_schema)):
                            schema.validate(g, h.backend.max_batch_size, what=f"gradient {j} of expert {uid}")
                    except InvalidRequest as e:
                        refused[i] = e
            key = (ctx.peer_id, graph_id) if graph_id is not None else None
            members.append(_Member(i, uid, h, key, rows))
        return _Received(members, inputs, grads, refused)

    def _resolve(
        self, request: GroupRequest, what: str, backward: bool
    ) -> tuple[list[HostedExpert | None], dict[int, SwarmError]]:
        hosted: list[HostedExpert | None] = []
        refused: dict[int, SwarmError] = {}
        for i, (uid, _, _) in enumerate(request.members):
            expert = self.experts.get(uid)
            if expert is None:
                error = NotFound(f"{what}: expert {shown_uid(uid)} is not hosted by {self.peer.peer_id}")
                if backward:  # the layout of the gradients depends on the expert's outputs
                    raise error
                refused[i] = error
            hosted.append(expert)
        if len(refused) == len(hosted):
            raise NotFound(f"{what}: none of the {len(hosted)} experts asked for is hosted by {self.peer.peer_id}")
        return hosted, refused

    def _check_layout(
        self, request: GroupRequest, hosted: Sequence[HostedExpert | None], what: str, backward: bool
    ) -> int:
        """Checks every declared tensor against the experts' schemas; returns the request's bytes."""
        present = [h.backend for h in hosted if h is not None]
        args_schema = present[0].args_schema
        if any(b.args_schema != args_schema for b in present):
            raise InvalidRequest(f"{what}: the experts of one group call must take the same inputs")
        if request.num_inputs != len(args_schema):
            raise InvalidRequest(f"{what}: expected {len(args_schema)} shared inputs, got {request.num_inputs}")
        metas = list(request.header.tensors)
        num_grads = sum(len(b.outputs_schema) for b in present) if backward else 0
        expected = request.num_inputs + num_grads + sum(has_rows for _, _, has_rows in request.members)
        if len(metas) != expected:
            raise InvalidRequest(f"{what}: expected {expected} tensors, got {len(metas)}")
        max_rows = min(b.max_batch_size for b in present)
        batch, nbytes = check_declared_batch(metas[: request.num_inputs], args_schema, max_rows, what)
        row_metas = iter(metas[request.num_inputs + num_grads :])
        offset = request.num_inputs
        for (uid, _, has_rows), h in zip(request.members, hosted):
            share = batch
            if has_rows:
                meta = next(row_metas)
                if meta.dtype != "int64" or len(meta.shape) != 1 or not 1 <= meta.shape[0] <= batch:
                    raise InvalidRequest(
                        f"{what}: the rows of {shown_uid(uid)} must be an int64 vector of 1 to {batch} indices, "
                        f"got {meta.dtype}{list(meta.shape)}"
                    )
                share = meta.shape[0]
                nbytes += meta.nbytes
            if backward and h is not None:
                schemas = h.backend.outputs_schema
                _, grad_bytes = check_declared_batch(
                    metas[offset : offset + len(schemas)], schemas, h.backend.max_batch_size,
                    f"{what}: gradients of {uid}", rows=share,
                )
                nbytes += grad_bytes
                offset += len(schemas)
        return nbytes


def _checked_rows(rows: torch.Tensor, batch: int, uid: str, what: str) -> torch.Tensor:
    index = rows.numpy()
    if index[0] < 0 or index[-1] >= batch or bool((np.diff(index) <= 0).any()):
        raise InvalidRequest(f"{what}: the rows of {shown_uid(uid)} must be strictly increasing indices below {batch}")
    return rows


def _share(inputs: Sequence[torch.Tensor], rows: torch.Tensor | None) -> list[torch.Tensor]:
    return list(inputs) if rows is None else [row_ops.take_rows(t, rows) for t in inputs]


def _refusals(received: _Received) -> Iterator[bytes]:
    for index, error in sorted(received.refused.items()):
        logger.debug("group call: expert %s refused: %s", received.members[index].uid, error)
        yield from tensors_to_messages([], error_metadata(index, error))


class _GradientSum:
    """The input gradients summed over the experts of a backward group that answered."""

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        self.inputs = inputs
        self.totals: list[torch.Tensor] | None = None
        self.answered: list[int] = []

    def add(self, member: _Member, grads: tuple[torch.Tensor, ...]) -> None:
        if self.totals is None:
            self.totals = [row_ops.zeros(tuple(t.shape), t.dtype) for t in self.inputs]
        for total, grad in zip(self.totals, grads):
            if member.rows is None:
                row_ops.add_(total, grad)
            else:
                row_ops.add_rows_(total, member.rows, grad)
        self.answered.append(member.index)


async def _each_completed(
    members: Sequence[_Member], futures: Sequence[asyncio.Future[tuple[torch.Tensor, ...]]]
) -> AsyncGenerator[tuple[_Member, tuple[torch.Tensor, ...] | SwarmError], None]:
    """Yields ``(member, outputs or SwarmError)`` as each expert's task finishes; cancels the
    tasks not finished when closed early (the call was cancelled)."""
    by_future = dict(zip(futures, members))
    pending = set(futures)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                error = future.exception()
                if error is not None and not isinstance(error, SwarmError):
                    raise error
                yield by_future[future], error if error is not None else future.result()  # type: ignore[misc]
    finally:
        for future in pending:
            future.cancel()
