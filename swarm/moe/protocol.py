"""The expert wire protocol (proto/moe.proto): method paths, request metadata, and the client calls.

Forward and Backward are bidirectional raw-bytes streams carrying one tensor bundle each way
(`swarm.net.streaming`: a header, then ~1 MiB chunks); the request header's metadata names the
expert and, optionally, a graph id. A Forward's answer says ``{"kept": true}`` when the server
kept that forward's graph; the Backward may then carry the output gradients alone
(``"inputs": false``), and resends with the inputs if the answer is ``{"graph": "gone"}``. Info is
a unary call with protobuf messages. The server side (`rpc_*`) lives in `swarm.moe.server.expert_server`; this
module holds the client side (`call_*`) and what both sides share. Several experts of one server
can share one stream: `swarm.moe.group_calls`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarm.core.errors import DeadlineExceeded, InvalidRequest
from swarm.moe.schema import TensorSchema
from swarm.net.channels import PeerChannel
from swarm.net.streaming import receive_tensors, tensors_to_messages
from swarm.proto import moe_pb2, tensor_pb2

__all__ = [
    "BACKWARD",
    "FORWARD",
    "GRAPH_GONE",
    "INFO",
    "ExpertCall",
    "ExpertInfo",
    "call_backward",
    "call_forward",
    "call_forward_keeping",
    "call_info",
    "parse_call_header",
    "shown_uid",
    "stream_slot",
]

FORWARD = "/swarm.moe.Expert/Forward"
BACKWARD = "/swarm.moe.Expert/Backward"
INFO = "/swarm.moe.Expert/Info"

MAX_RESPONSE_BYTES = 1 << 31
"""The largest tensor bundle a client accepts in a response."""

GRAPH_GONE = "gone"
"""A Backward answer's metadata ``{"graph": GRAPH_GONE}`` (and no tensors): the request left out the
inputs, but the server no longer keeps that forward's graph; send them."""


_SHOWN_UID_CHARS = 64


def shown_uid(uid: str) -> str:
    """`uid` as error messages show it: in full up to 64 characters, else cut with its length
    (a status must never echo unbounded input back to the caller)."""
    if len(uid) <= _SHOWN_UID_CHARS:
        return repr(uid)
    return f"{uid[:_SHOWN_UID_CHARS]!r}... ({len(uid)} characters)"


@dataclass(frozen=True)
class ExpertCall:
    """What a Forward/Backward request header says besides its tensors.

    Attributes:
        uid: the expert asked for.
        graph_id: names a forward whose autograd graph the server may keep for the backward
            that follows (None: the caller will not call backward, or does not care).
        inputs: whether a Backward carries the forward's inputs before the output gradients;
            without them (the forward's answer said the server kept its graph) it needs `graph_id`.
    """

    uid: str
    graph_id: int | None = None
    inputs: bool = True

    def to_metadata(self) -> dict[str, Any]:
        metadata: dict[str, Any] = {"uid": self.uid, "graph": self.graph_id}
        if not self.inputs:
            metadata["inputs"] = False
        return metadata


def decode_request_header(header_bytes: bytes, what: str) -> tuple[tensor_pb2.TensorBundleHeader, Any]:
    """The first message of a call: its tensor bundle header and unpacked metadata.

    Raises:
        InvalidRequest: either cannot be decoded.
    """
    from swarm.core.serialization import unpack

    try:
        header = tensor_pb2.TensorBundleHeader.FromString(header_bytes)
        return header, (unpack(header.metadata) if header.metadata else None)
    except Exception as e:  # noqa: BLE001 - any decoding failure is the caller's malformed request
        raise InvalidRequest(f"malformed {what} header: {e}") from None


def parse_call_header(header_bytes: bytes) -> tuple[ExpertCall, tensor_pb2.TensorBundleHeader]:
    """Reads the expert call out of a request's first message, before any tensor is allocated.

    Raises:
        InvalidRequest: the header or its metadata is malformed.
    """
    header, metadata = decode_request_header(header_bytes, "expert request")
    if not isinstance(metadata, dict) or not isinstance(metadata.get("uid"), str):
        raise InvalidRequest("expert request header must carry metadata {'uid': str, 'graph': int | None}")
    graph_id = metadata.get("graph")
    if graph_id is not None and (not isinstance(graph_id, int) or isinstance(graph_id, bool)):
        raise InvalidRequest(f"expert request graph id must be an int, got {type(graph_id).__name__}")
    inputs = metadata.get("inputs", True)
    if not isinstance(inputs, bool):
        raise InvalidRequest(f"expert request 'inputs' must be a bool, got {type(inputs).__name__}")
    if not inputs and graph_id is None:
        raise InvalidRequest("a backward without its inputs must name the kept forward's graph id")
    return ExpertCall(metadata["uid"], graph_id, inputs), header


@dataclass(frozen=True)
class ExpertInfo:
    """What a client knows about a remote expert (the answer to Info).

    Attributes:
        uid: the expert's UID.
        expert_class: its module's class name.
        args_schema: one schema per input tensor.
        outputs_schema: one schema per output tensor.
        max_batch_size: the most rows one call may carry.
        num_parameters: trainable and frozen parameters of the module.
        updates: optimizer steps the expert has taken.
    """

    uid: str
    expert_class: str
    args_schema: tuple[TensorSchema, ...]
    outputs_schema: tuple[TensorSchema, ...]
    max_batch_size: int
    num_parameters: int
    updates: int

    def to_proto(self) -> moe_pb2.ExpertInfo:
        def schema(s: TensorSchema) -> moe_pb2.TensorSchema:
            d = s.to_dict()
            return moe_pb2.TensorSchema(shape=d["shape"], dtype=d["dtype"])

        return moe_pb2.ExpertInfo(
            uid=self.uid,
            expert_class=self.expert_class,
            args_schema=[schema(s) for s in self.args_schema],
            outputs_schema=[schema(s) for s in self.outputs_schema],
            max_batch_size=self.max_batch_size,
            num_parameters=self.num_parameters,
            updates=self.updates,
        )

    @classmethod
    def from_proto(cls, message: moe_pb2.ExpertInfo) -> ExpertInfo:
        """Parses an Info answer.

        Raises:
            InvalidRequest: the answer names an unknown dtype or a malformed shape.
        """
        try:
            def schemas(items: Any) -> tuple[TensorSchema, ...]:
                return tuple(TensorSchema.from_dict({"shape": list(s.shape), "dtype": s.dtype}) for s in items)

            return cls(
                message.uid,
                message.expert_class,
                schemas(message.args_schema),
                schemas(message.outputs_schema),
                int(message.max_batch_size),
                int(message.num_parameters),
                int(message.updates),
            )
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"malformed expert info for {message.uid!r}: {e}") from None


MAX_STREAMS_PER_PEER = 128
"""Expert calls one client keeps in flight per server; the rest wait their turn in the client.

One gRPC connection carries at most the server's max_concurrent_streams (512); past it, or when
the server's accounting of closed streams lags under load, streams are refused (RST_STREAM
REFUSED_STREAM) and, with transparent retries off, surface as errors. Queueing in the client keeps
a burst from one caller orderly; the server's own limits (`swarm.moe.server.admission`) still apply."""

@contextlib.asynccontextmanager
async def stream_slot(channel: PeerChannel, what: str, timeout: float | None) -> AsyncIterator[float]:
    """Holds one of the `MAX_STREAMS_PER_PEER` stream slots to `channel`'s peer; yields the seconds
    left of `timeout` (default: the pool's) once the slot is held.

    Raises:
        DeadlineExceeded: no slot came free within `timeout`.
    """
    timeout = timeout or channel.pool.config.default_timeout
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    slots = channel.limit("moe.streams", MAX_STREAMS_PER_PEER)
    try:
        await asyncio.wait_for(slots.acquire(), timeout)
    except TimeoutError:
        raise DeadlineExceeded(
            f"{what} waited {timeout:.1f} s for one of {MAX_STREAMS_PER_PEER} streams to {channel.peer_id}",
            peer_id=channel.peer_id,
        ) from None
    try:
        yield max(deadline - loop.time(), 1e-3)
    finally:
        slots.release()


async def _call(
    channel: PeerChannel, method: str, call: ExpertCall, tensors: Sequence[torch.Tensor], timeout: float | None
) -> tuple[list[torch.Tensor], Any]:
    async with stream_slot(channel, f"{method} of {call.uid}", timeout) as remaining:
        responses = channel.stream(method, tensors_to_messages(tensors, call.to_metadata()), remaining)
        async with contextlib.aclosing(responses):
            return await receive_tensors(responses, MAX_RESPONSE_BYTES)


async def call_forward(
    channel: PeerChannel,
    uid: str,
    inputs: Sequence[torch.Tensor],
    *,
    graph_id: int | None = None,
    timeout: float | None = None,
) -> list[torch.Tensor]:
    """Runs expert `uid` on a batch at the peer behind `channel`.

    Args:
        channel: a channel to the server.
        uid: the expert.
        inputs: one tensor per argument, sharing the batch dimension.
        graph_id: ask the server to keep this forward's graph for a backward with the same id.
        timeout: the call's deadline in seconds.

    Returns:
        The expert's outputs.

    Raises:
        RPCError: a subclass saying why (InvalidRequest, ResourceExhausted, NotFound,
            PeerUnreachable, DeadlineExceeded, RemoteError).
    """
    outputs, _ = await call_forward_keeping(channel, uid, inputs, graph_id=graph_id, timeout=timeout)
    return outputs


async def call_forward_keeping(
    channel: PeerChannel,
    uid: str,
    inputs: Sequence[torch.Tensor],
    *,
    graph_id: int | None = None,
    timeout: float | None = None,
) -> tuple[list[torch.Tensor], bool]:
    """As `call_forward`, and whether the server kept the forward's graph under `graph_id` (the
    backward may then leave the inputs out: ``call_backward(..., graph_kept=True)``)."""
    outputs, metadata = await _call(channel, FORWARD, ExpertCall(uid, graph_id), inputs, timeout)
    return outputs, graph_id is not None and isinstance(metadata, dict) and metadata.get("kept") is True


async def call_backward(
    channel: PeerChannel,
    uid: str,
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    *,
    graph_id: int | None = None,
    timeout: float | None = None,
    graph_kept: bool = False,
) -> list[torch.Tensor]:
    """Sends the gradients of expert `uid`'s outputs; the expert trains on them.

    Args:
        channel: a channel to the server.
        uid: the expert.
        inputs: the inputs of the forward these gradients belong to.
        grad_outputs: one gradient per output.
        graph_id: the id passed to the matching `call_forward`, if any.
        timeout: the call's deadline in seconds.
        graph_kept: the forward's answer said the server kept its graph: send the gradients
            alone, and the inputs only if the server no longer has that graph.

    Returns:
        The gradients w.r.t. the inputs.

    Raises:
        RPCError: as `call_forward`.
    """
    timeout = timeout or channel.pool.config.default_timeout
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    if graph_kept and graph_id is not None:
        grads, metadata = await _call(channel, BACKWARD, ExpertCall(uid, graph_id, inputs=False), grad_outputs, timeout)
        if not (isinstance(metadata, dict) and metadata.get("graph") == GRAPH_GONE):
            return grads
        timeout = deadline - loop.time()
        if timeout <= 0:
            raise DeadlineExceeded(f"{BACKWARD} of {uid}: no time left to resend the inputs", peer_id=channel.peer_id)
    grads, _ = await _call(channel, BACKWARD, ExpertCall(uid, graph_id), [*inputs, *grad_outputs], timeout)
    return grads


async def call_info(channel: PeerChannel, uid: str, timeout: float | None = None) -> ExpertInfo:
    """Asks the peer behind `channel` to describe expert `uid`.

    Raises:
        RPCError: as `call_forward` (NotFound if the peer does not host `uid`).
    """
    response = await channel.unary(INFO, moe_pb2.ExpertInfoRequest(uid=uid), moe_pb2.ExpertInfo, timeout)
    return ExpertInfo.from_proto(response)
