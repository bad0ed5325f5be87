"""RemoteExpert: an expert served by another peer, used like a local differentiable module.

Its forward sends the inputs to the server (Forward RPC); autograd's backward sends the output
gradients back (Backward RPC), which returns the input gradients and makes the server train the
expert with its own optimizer. Both are blocking calls through the peer's loop bridge
(`peer.run`); `acall_forward`/`acall_backward` are the awaitable forms (no autograd).

A forward made with grad mode on carries a random graph id, so the server can keep that
forward's graph for the backward instead of recomputing it (`swarm.moe.server.saved_graphs`); when the
server says it kept it, the backward sends the output gradients without the inputs (and the
inputs only if the graph is gone by then).

Every answer is checked before it is returned (`swarm.moe.client.answer_checks.ExpertGuard`): the
outputs against the schema the expert declared, the input gradients against the inputs, all
finite, and within a magnitude bound learned from the expert's own answers. An answer that fails
raises `MisbehavingExpert` (a `MoEError`), is logged and counted in
``swarm_moe_rejected_answers_total``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from swarm.core.errors import ConfigError, MoEError
from swarm.dht.handle import PeerHandle
from swarm.moe.client.answer_checks import AnswerChecks, ExpertGuard
from swarm.moe.client.jobs import new_graph_id
from swarm.moe.protocol import ExpertInfo, call_backward, call_forward_keeping, call_info
from swarm.moe.schema import TensorSchema
from swarm.moe.sources import ExpertSource

__all__ = ["RemoteExpert"]

_BRIDGE_SLACK = 5.0  # the blocking bridge waits this much longer than the RPC deadline


def as_payload(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's data as sent on the wire: detached, on the CPU, contiguous. A CUDA tensor is
    copied once, into pinned host memory (a direct DMA transfer); the copy waits for the device,
    so callers make payloads on their own thread, never on the peer's loop (`payloads`)."""
    if tensor.device.type == "cuda":
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return staged.copy_(tensor.detach())
    return tensor.detach().cpu().contiguous()


async def payloads(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`as_payload` of each tensor, for a coroutine: tensors on a device are copied in a worker
    thread, so the peer's loop never waits for the device."""
    if any(t.device.type != "cpu" for t in tensors):
        return await asyncio.to_thread(lambda: [as_payload(t) for t in tensors])
    return [as_payload(t) for t in tensors]


class RemoteExpert(nn.Module):
    """A remote expert as a differentiable module.

    Args:
        peer: the calling `swarm.Peer` (client mode is fine).
        uid: the expert's UID, e.g. ``"ffn.0.0"``.
        addr: the server's multiaddr (ending in /p2p/<PeerID>); None looks it up in
            `source` (default: the peer's DHT) at the first call.
        forward_timeout: deadline of each Forward call, seconds.
        backward_timeout: deadline of each Backward call, seconds.
        source: where to look the expert up when `addr` is None.
        checks: how its answers are checked (default `AnswerChecks()`: on; the first call with
            checks on also asks the expert's schema, once).

    Raises:
        ValueError: no `addr`, and no `source` nor DHT to find it.
        MisbehavingExpert: (from a call) the expert's answer failed the checks.
    """

    def __init__(
        self,
        peer: PeerHandle,
        uid: str,
        addr: str | None = None,
        *,
        forward_timeout: float = 30.0,
        backward_timeout: float = 30.0,
        source: ExpertSource | None = None,
        checks: AnswerChecks | None = None,
    ) -> None:
        super().__init__()
        if addr is None and source is None:
            from swarm.moe.dht_declare import DHTExpertSource

            if peer.dht is None:
                raise ConfigError("this peer has no DHT to find experts in: pass their address or a source")
            source = DHTExpertSource(peer.dht)
        if not forward_timeout > 0 or not backward_timeout > 0:
            raise ValueError("timeouts must be positive")
        self.peer = peer
        self.uid = uid
        self._addr = addr
        self.source = source
        self.forward_timeout = forward_timeout
        self.backward_timeout = backward_timeout
        self._info: ExpertInfo | None = None
        self.guard = ExpertGuard(checks or AnswerChecks(), uid)
        self._output_schemas: tuple[TensorSchema, ...] | None = None

    # ---- awaitable forms ------------------------------------------------------------------------

    async def aresolve(self) -> str:
        """The server's address, looked up once (raises `MoEError` if the expert is not declared)."""
        if self._addr is None:
            if self.source is None:
                raise MoEError(f"expert {self.uid}: no address and nowhere to look it up")
            found = await self.source.get_experts([self.uid])
            if self.uid not in found:
                raise MoEError(f"expert {self.uid} is not declared by any live server")
            self._addr = found[self.uid]
        return self._addr

    async def ainfo(self) -> ExpertInfo:
        """The expert's schemas and limits (asked once, then cached)."""
        if self._info is None:
            channel = self.peer.pool.get(await self.aresolve())
            self._info = await call_info(channel, self.uid, self.forward_timeout)
        return self._info

    async def acall_forward(self, *inputs: torch.Tensor, graph_id: int | None = None) -> list[torch.Tensor]:
        """Runs the expert on `inputs` (no autograd); raises swarm's `RPCError` subclasses, and
        `MisbehavingExpert` for an answer that fails the checks."""
        sent = await payloads(inputs)
        outputs, _ = await self._forward(sent, graph_id)
        self._check_outputs(sent, outputs)
        return outputs

    async def _forward(self, sent: list[torch.Tensor], graph_id: int | None) -> tuple[list[torch.Tensor], bool]:
        """The Forward call with `sent`, the inputs' payloads (made off the loop); the answer is not
        checked yet (`_check_outputs`), but the schema it is checked against is known."""
        channel = self.peer.pool.get(await self.aresolve())
        if self.guard.checks.enabled and self._output_schemas is None:
            info = self._info or await call_info(channel, self.uid, self.forward_timeout)
            self._output_schemas = info.outputs_schema
        return await call_forward_keeping(channel, self.uid, sent, graph_id=graph_id, timeout=self.forward_timeout)

    def _check_outputs(self, sent: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        if self._output_schemas is not None:
            self.guard.check_outputs(str(self._addr), sent, outputs, self._output_schemas)

    async def acall_backward(
        self, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor], graph_id: int | None = None,
        graph_kept: bool = False,
    ) -> list[torch.Tensor]:
        """Sends output gradients; returns input gradients (the server trains the expert).

        With `graph_kept` (the forward's server kept its graph), the inputs are sent only if the
        server no longer has that graph.
        """
        sent, sent_grads = await payloads(inputs), await payloads(grad_outputs)
        grads = await self._backward(sent, sent_grads, graph_id, graph_kept)
        self.guard.check_grads(str(self._addr), sent, sent_grads, grads)
        return grads

    async def _backward(self, inputs: list[torch.Tensor], grad_outputs: list[torch.Tensor], graph_id: int | None,
                        graph_kept: bool) -> list[torch.Tensor]:
        """The Backward call with payloads made off the loop."""
        channel = self.peer.pool.get(await self.aresolve())
        return await call_backward(channel, self.uid, inputs, grad_outputs, graph_id=graph_id,
                                   timeout=self.backward_timeout, graph_kept=graph_kept)

    # ---- blocking forms ---------------------------------------------------------------------------

    @property
    def info(self) -> ExpertInfo:
        """Blocking form of `ainfo`."""
        return self.peer.run(self.ainfo(), self.forward_timeout + _BRIDGE_SLACK)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Calls the expert; differentiable w.r.t. `inputs`, and its backward trains the expert.

        Returns:
            The output tensor, or a tuple when the expert has several outputs.
        """
        graph_id = new_graph_id() if torch.is_grad_enabled() else None
        outputs = _RemoteExpertCall.apply(_DUMMY, self, graph_id, *inputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def extra_repr(self) -> str:
        return f"uid={self.uid!r}, addr={self._addr!r}"


_DUMMY = torch.empty(0, requires_grad=True)
"""Makes autograd call the backward (and so train the expert) even when no input requires grad."""


class _RemoteExpertCall(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, dummy: torch.Tensor, expert: RemoteExpert, graph_id: int | None, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        sent = [as_payload(x) for x in inputs]  # on this thread: a device copy never waits on the loop
        outputs, kept = expert.peer.run(expert._forward(sent, graph_id), expert.forward_timeout + _BRIDGE_SLACK)
        expert._check_outputs(sent, outputs)
        ctx.expert, ctx.graph_id, ctx.graph_kept = expert, graph_id, kept
        ctx.save_for_backward(*inputs)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        expert: RemoteExpert = ctx.expert
        inputs = ctx.saved_tensors
        sent, sent_grads = [as_payload(x) for x in inputs], [as_payload(g) for g in grad_outputs]
        grads = expert.peer.run(expert._backward(sent, sent_grads, ctx.graph_id, ctx.graph_kept),
                                expert.backward_timeout + _BRIDGE_SLACK)
        expert.guard.check_grads(str(expert._addr), sent, sent_grads, grads)
        return (None, None, None, *(g.to(x.device) for g, x in zip(grads, inputs)))
