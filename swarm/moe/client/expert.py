"""RemoteExpert: an expert served by another peer, used like a local differentiable module.

Its forward sends the inputs to the server (Forward RPC); autograd's backward sends the output
gradients back (Backward RPC), which returns the input gradients and makes the server train the
expert with its own optimizer. Both are blocking calls through the peer's loop bridge
(`peer.run`); `acall_forward`/`acall_backward` are the awaitable forms (no autograd).

A forward made with grad mode on carries a random graph id, so the server can keep that
forward's graph for the backward instead of recomputing it (`swarm.moe.server.saved_graphs`); when the
server says it kept it, the backward sends the output gradients without the inputs (and the
inputs only if the graph is gone by then).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from swarm.core.errors import ConfigError, MoEError
from swarm.dht.handle import PeerHandle
from swarm.moe.client.jobs import new_graph_id
from swarm.moe.protocol import ExpertInfo, call_backward, call_forward_keeping, call_info
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

    Raises:
        ValueError: no `addr`, and no `source` nor DHT to find it.
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
        """Runs the expert on `inputs` (no autograd); raises swarm's `RPCError` subclasses."""
        outputs, _ = await self._forward(await payloads(inputs), graph_id)
        return outputs

    async def _forward(self, sent: list[torch.Tensor], graph_id: int | None) -> tuple[list[torch.Tensor], bool]:
        """The Forward call with `sent`, the inputs' payloads (made off the loop)."""
        channel = self.peer.pool.get(await self.aresolve())
        return await call_forward_keeping(channel, self.uid, sent, graph_id=graph_id, timeout=self.forward_timeout)

    async def acall_backward(
        self, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor], graph_id: int | None = None,
        graph_kept: bool = False,
    ) -> list[torch.Tensor]:
        """Sends output gradients; returns input gradients (the server trains the expert).

        With `graph_kept` (the forward's server kept its graph), the inputs are sent only if the
        server no longer has that graph.
        """
        return await self._backward(await payloads(inputs), await payloads(grad_outputs), graph_id, graph_kept)

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
        ctx.expert, ctx.graph_id, ctx.graph_kept = expert, graph_id, kept
        ctx.save_for_backward(*inputs)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        expert: RemoteExpert = ctx.expert
        inputs = ctx.saved_tensors
        grads = expert.peer.run(
            expert._backward([as_payload(x) for x in inputs], [as_payload(g) for g in grad_outputs], ctx.graph_id,
                             ctx.graph_kept),
            expert.backward_timeout + _BRIDGE_SLACK,
        )
        return (None, None, None, *(g.to(x.device) for g, x in zip(grads, inputs)))
