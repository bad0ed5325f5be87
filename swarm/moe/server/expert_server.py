"""ExpertServer: hosts experts on a peer, trains them on the backward calls of remote clients.

It registers five RPCs on the peer's gRPC server (proto/moe.proto): Forward and Backward
(tensor streams, batched across callers by the `Runtime`'s compute threads), their group forms
ForwardGroup and BackwardGroup (several experts per stream, `swarm.moe.server.group_serving`) and Info.
Each request is checked before it costs anything (`swarm.moe.server.admission`): the expert must be
hosted (NOT_FOUND), the declared tensors must fit its schemas (INVALID_ARGUMENT) and its batch
limit, and the server's bounds on requests and bytes in flight must allow it
(RESOURCE_EXHAUSTED); then the received tensors are checked in full (NaN/Inf) per request, so
one bad request never fails a batch. The experts are declared in the DHT when the peer has one
(`swarm.moe.dht_declare`), checkpointed periodically and at shutdown, and restored at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarm.core.errors import ConfigError, NotFound, PeerUnreachable
from swarm.dht.handle import PeerHandle
from swarm.moe.dht_declare import ExpertDeclarer
from swarm.moe.group_calls import BACKWARD_GROUP, FORWARD_GROUP
from swarm.moe.protocol import BACKWARD, FORWARD, GRAPH_GONE, INFO, ExpertCall, parse_call_header, shown_uid
from swarm.moe.schema import TensorSchema
from swarm.moe.server.admission import Admission, check_declared, receive_header
from swarm.moe.server.backend import ExpertBackend
from swarm.moe.server.checkpoints import CheckpointSaver
from swarm.moe.server.config import ExpertServerConfig
from swarm.moe.server.experts import OptimizerFactory, backend_for_module, default_optimizer, make_backend
from swarm.moe.server.gradient_bounds import GradientBound
from swarm.moe.server.group_serving import GroupCallHandlers
from swarm.moe.server.hosted import GraphGone, HostedExpert
from swarm.moe.server.runtime import Runtime
from swarm.moe.server.task_pool import PoolStats
from swarm.moe.uids import expand_pattern
from swarm.net.nat import NatTraversal
from swarm.net.server import CallContext
from swarm.net.streaming import tensors_to_messages
from swarm.proto import moe_pb2

__all__ = ["ExpertServer"]

logger = logging.getLogger(__name__)

class ExpertServer(GroupCallHandlers):
    """Serves experts from a peer; attaches to it, so `peer.shutdown()` stops it and saves checkpoints.

    Example::

        server = ExpertServer(peer, {"ffn.0.0": FeedforwardExpert(1024)},
                              optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.01))
        ...
        server.shutdown()   # or peer.shutdown()

    Args:
        peer: a `swarm.Peer` that is not in client mode.
        experts: ``{uid: module or ExpertBackend}``; UIDs like ``"ffn.0.3"``.
        optimizer_factory: builds each module's optimizer from its trainable parameters
            (default: Adam, lr 1e-3). Not used for `ExpertBackend` values (they have theirs).
        args_schema: the input schemas of plain modules (default: inferred from the first
            ``Linear``/``LayerNorm`` of the module, a float32 ``(batch, features)`` input).
        checkpoint_dir: restore experts from here at start, save here periodically and at shutdown.
        config: limits and periods.
        declare: declare the experts in the peer's DHT (when it has one).
        start: start serving now; with False, ``await server.astart()`` from an event loop.

    Raises:
        ConfigError: the peer cannot serve (client mode) or already hosts an ExpertServer.
        ValueError: an invalid UID or schema, or a module whose input schema cannot be inferred.
        CheckpointError: a checkpoint exists in `checkpoint_dir` but does not fit.
    """

    def __init__(
        self,
        peer: PeerHandle,
        experts: Mapping[str, nn.Module | ExpertBackend],
        optimizer_factory: OptimizerFactory | None = None,
        *,
        args_schema: Sequence[TensorSchema] | None = None,
        checkpoint_dir: str | Path | None = None,
        config: ExpertServerConfig | None = None,
        declare: bool = True,
        start: bool = True,
    ) -> None:
        if peer.server is None:
            raise ConfigError("a client-mode peer cannot serve experts (it accepts no connections)")
        self._server = peer.server
        if not experts:
            raise ValueError("an ExpertServer needs at least one expert")
        self.peer = peer
        self.config = config or ExpertServerConfig()
        factory = optimizer_factory or default_optimizer
        self.backends: dict[str, ExpertBackend] = {
            uid: backend_for_module(uid, expert, factory, args_schema, self.config.max_batch_size)
            for uid, expert in experts.items()
        }
        self.checkpoints = (
            CheckpointSaver(self.backends, checkpoint_dir, self.config.checkpoint_interval)
            if checkpoint_dir is not None
            else None
        )
        if self.checkpoints is not None:
            self.checkpoints.check_writable()  # a read-only directory fails now, not at the first save
        self.restored: list[str] = self.checkpoints.load() if self.checkpoints is not None else []
        """UIDs restored from checkpoints at start."""
        cfg = self.config
        self.experts = {
            uid: HostedExpert(
                b, cfg.batching,
                GradientBound(cfg.grad_clip_ratio, cfg.grad_clip_window) if cfg.grad_clip_ratio is not None else None,
                cfg.hostile,
            )
            for uid, b in self.backends.items()
        }
        if cfg.hostile is not None:
            logger.warning("this expert server is HOSTILE (a fault for tests and demos): its experts answer %s",
                           cfg.hostile)
        threads = self.config.compute_threads or torch.get_num_threads()
        self.runtime = Runtime(
            [pool for hosted in self.experts.values() for pool in hosted.pools], threads,
            self.config.compute_workers or threads,
        )
        self.admission = Admission(self.config.max_inflight_requests, self.config.max_inflight_bytes,
                                   self.config.max_inflight_per_caller, self.config.max_inflight_per_source)
        self.declarer: ExpertDeclarer | None = None
        self._declare = declare
        self._started = False
        self._closing = False
        if start:
            peer.run(self.astart())

    @classmethod
    def from_pattern(
        cls,
        peer: PeerHandle,
        pattern: str,
        expert_cls: str = "ffn",
        hidden_dim: int = 1024,
        optimizer_factory: OptimizerFactory | None = None,
        *,
        checkpoint_dir: str | Path | None = None,
        config: ExpertServerConfig | None = None,
        declare: bool = True,
        start: bool = True,
    ) -> ExpertServer:
        """Serves every expert a pattern names, built from a registered class (`swarm.moe.server.experts`).

        Args:
            peer: the serving peer.
            pattern: e.g. ``"ffn.[0:4].[0:4]"`` (16 experts).
            expert_cls: ``"ffn"``, ``"transformer"``, ``"nop"`` or a registered class.
            hidden_dim: the experts' hidden size.
            optimizer_factory: as in the constructor.
            checkpoint_dir, config, declare, start: as in the constructor.
        """
        config = config or ExpertServerConfig()
        backends = {
            uid: make_backend(
                expert_cls, uid, hidden_dim, optimizer_factory or default_optimizer, config.max_batch_size
            )
            for uid in expand_pattern(pattern)
        }
        return cls(peer, backends, checkpoint_dir=checkpoint_dir, config=config, declare=declare, start=start)

    # ---- lifecycle ----------------------------------------------------------------------------

    async def astart(self) -> None:
        """Starts serving: registers the RPCs, starts the compute threads, declares the experts."""
        if self.peer.loop.loop is not _running_loop():
            return await self.peer.loop.wrap(self.astart())
        if self._started:
            return
        if ExpertServer in self.peer.services:
            raise ConfigError("this peer already hosts an ExpertServer; give one server all its experts")
        self.peer.services.add(self)
        self._started = True
        self.runtime.start()
        if self.checkpoints is not None and self.config.checkpoint_interval is not None:
            self.checkpoints.start()
        server = self._server
        server.add_stream(FORWARD, self.rpc_forward)
        server.add_stream(BACKWARD, self.rpc_backward)
        server.add_stream(FORWARD_GROUP, self.rpc_forward_group)
        server.add_stream(BACKWARD_GROUP, self.rpc_backward_group)
        server.add_unary(INFO, self.rpc_info, moe_pb2.ExpertInfoRequest)
        self.peer.attach(self)
        self.peer.served_experts = sorted(self.experts)
        if self._declare and self.peer.dht is not None and self.peer.addrs:
            self.declarer = ExpertDeclarer(self.peer.dht, list(self.experts), _public_addr(self.peer.addrs),
                                           self.config.declare_ttl)
            await self.declarer.astart()
            nat = self.peer.services.get(NatTraversal)  # behind NAT, its relays may change (docs/relay.md)
            if nat is not None:
                declarer = self.declarer
                nat.on_addrs_changed.append(lambda addrs: declarer.readdress(_public_addr(addrs)))
        elif self._declare:
            logger.info("peer has no DHT: %d experts served but not declared", len(self.experts))
        logger.info("serving %d experts (%s%s)", len(self.experts), next(iter(self.experts)),
                    ", ..." if len(self.experts) > 1 else "")

    async def ashutdown(self) -> None:
        """Stops declaring, fails queued requests, stops the compute threads, saves checkpoints."""
        if self._closing:
            return
        self._closing = True
        try:
            if self.declarer is not None:
                await self.declarer.aclose()
            await asyncio.to_thread(self.runtime.shutdown, self.config.runtime_shutdown_timeout)
            if self.checkpoints is not None:
                await asyncio.to_thread(self.checkpoints.stop, True)
        finally:
            self.peer.served_experts = []
            self.peer.detach(self)
            self.peer.services.remove(self)

    def shutdown(self) -> None:
        """Blocking form of `ashutdown`."""
        self.peer.run(self.ashutdown(), timeout=120)

    # ---- RPCs ---------------------------------------------------------------------------------

    def _hosted(self, uid: str, what: str) -> HostedExpert:
        if self._closing:
            raise PeerUnreachable(f"expert server {self.peer.peer_id} is shutting down")
        hosted = self.experts.get(uid)
        if hosted is None:
            raise NotFound(f"{what}: expert {shown_uid(uid)} is not hosted by {self.peer.peer_id}")
        return hosted

    def _request(
        self, requests: AsyncIterator[bytes], ctx: CallContext, backward: bool
    ) -> contextlib.AbstractAsyncContextManager[tuple[HostedExpert, ExpertCall, list[torch.Tensor], Hashable | None]]:
        """Admits one request; yields (hosted expert, call, tensors, graph key) and holds its slot and
        bytes until exit."""
        return self._admitted(requests, lambda stream, held: self._receive(stream, ctx, backward, held))

    async def _receive(
        self, stream: AsyncIterator[bytes], ctx: CallContext, backward: bool, held: contextlib.AsyncExitStack
    ) -> tuple[HostedExpert, ExpertCall, list[torch.Tensor], Hashable | None]:
        what = "backward" if backward else "forward"
        header_bytes = await receive_header(stream, self.config.header_timeout, what)
        call, header = parse_call_header(header_bytes)
        held.enter_context(self.admission.request(what, ctx.peer_id or "", ctx.source))
        hosted = self._hosted(call.uid, what)
        backend = hosted.backend
        what = f"{what} of {call.uid}"
        if not backward:
            schemas = backend.args_schema
        else:
            schemas = (backend.args_schema if call.inputs else ()) + backend.outputs_schema
        nbytes = check_declared(header, schemas, backend.max_batch_size, what)
        tensors = await self._receive_tensors(stream, header_bytes, nbytes, what, held)
        if not backward:
            backend.validate_forward_inputs(tensors, check_finite=self.config.check_finite)
        elif call.inputs:
            backend.validate_backward_inputs(tensors, check_finite=self.config.check_finite)
        else:
            backend.validate_grad_outputs(tensors, check_finite=self.config.check_finite)
        key = (ctx.peer_id, call.graph_id) if call.graph_id is not None else None
        return hosted, call, tensors, key

    async def rpc_forward(self, requests: AsyncIterator[bytes], ctx: CallContext) -> AsyncIterator[bytes]:
        """Forward: one bundle of inputs in, one bundle of outputs out (saying whether the graph was kept)."""
        async with self._request(requests, ctx, backward=False) as (hosted, _, inputs, key):
            outputs, kept = await hosted.forward(inputs, key)
            for message in tensors_to_messages(outputs, {"kept": True} if kept else None):
                yield message

    async def rpc_backward(self, requests: AsyncIterator[bytes], ctx: CallContext) -> AsyncIterator[bytes]:
        """Backward: inputs (unless the forward's graph was kept) and output gradients in, input
        gradients out; the expert takes a step."""
        async with self._request(requests, ctx, backward=True) as (hosted, call, tensors, key):
            metadata = None
            if call.inputs:
                grads = await hosted.backward(tensors, key)
            else:
                try:
                    grads = await hosted.backward_kept(tensors, key)
                except GraphGone:  # the caller resends with the inputs
                    grads, metadata = (), {"graph": GRAPH_GONE}
            for message in tensors_to_messages(grads, metadata):
                yield message

    async def rpc_info(self, request: moe_pb2.ExpertInfoRequest, ctx: CallContext) -> moe_pb2.ExpertInfo:
        """Info: the schemas and limits of one hosted expert."""
        return self._hosted(request.uid, "info").backend.describe().to_proto()

    # ---- introspection ------------------------------------------------------------------------

    async def await_idle(self) -> None:
        """Returns once no Forward/Backward call is in flight (awaitable form of `wait_idle`)."""
        if self.peer.loop.loop is not _running_loop():
            return await self.peer.loop.wrap(self.await_idle())
        await self.admission.wait_idle()

    def wait_idle(self, timeout: float | None = None) -> None:
        """Blocks until no Forward/Backward call is in flight (raises TimeoutError after `timeout`)."""
        self.peer.run(self.await_idle(), timeout)

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and tests: pools, requests in flight, refusals, kept graphs."""
        pools: dict[str, PoolStats] = self.runtime.stats()
        return {
            "pools": pools,
            "inflight_requests": self.admission.requests,
            "inflight_bytes": self.admission.bytes,
            "admitted": self.admission.admitted,
            "refused": self.admission.refused,
            "too_slow": self.admission.too_slow,
            "saved_graph_hits": sum(h.saved.hits for h in self.experts.values()),
            "saved_graph_misses": sum(h.saved.misses for h in self.experts.values()),
            "saved_graph_rows": sum(h.saved.rows for h in self.experts.values()),
            "checkpoint_failures": self.checkpoints.failures if self.checkpoints is not None else 0,
        }

    def __repr__(self) -> str:
        return f"ExpertServer({self.peer.peer_id}, {len(self.experts)} experts)"


def _public_addr(addrs: Sequence[str]) -> str:
    """The address to declare: the first that is not loopback, else the first."""
    for addr in addrs:
        if not addr.startswith(("/ip4/127.", "/ip6/::1/")):
            return addr
    return addrs[0]


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
