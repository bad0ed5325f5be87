"""Group calls: one Forward or Backward stream per server carrying all the experts a batch needs there.

A mixture often sends the same rows to several experts of one server (with k_best=4 on a 2x2
grid, every sample goes to all four). One stream per server instead of one per expert sends the
shared inputs once, lets the server queue every expert's task at the same moment (so its compute
workers split them at once, `swarm.moe.server.runtime`), and returns the input gradients already summed
over the server's experts. Wire format (proto/moe.proto), request bundle metadata::

    {"inputs": n, "experts": [{"uid": str, "graph": int | None, "rows": bool}, ...]}

and tensors, back to back: the n shared inputs (N rows each); for a Backward, each expert's output
gradients in expert order (one per output, as many rows as the expert's share); then, for each
expert whose ``rows`` is true, in expert order, an int64 vector of strictly increasing indices
into the N shared rows (its share; without one, an expert takes all N rows).

Responses are a sequence of bundles. ForwardGroup: one per expert as soon as it is computed,
``{"expert": i}`` with its outputs, or ``{"expert": i, "status": code, "error": message}`` and no
tensors when that expert failed (the others are unaffected). BackwardGroup: one error bundle per
failed expert, then ``{"experts": [i, ...]}`` with the input gradients summed over the experts
listed (N rows each; no tensors when none succeeded). A failure of the whole call (malformed
request, server limits) is the stream's gRPC status, as for single-expert calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from swarm.core.errors import InvalidRequest, RPCError
from swarm.moe.protocol import MAX_RESPONSE_BYTES, decode_request_header, stream_slot
from swarm.net.channels import PeerChannel
from swarm.net.errors import from_status, to_status
from swarm.net.streaming import receive_tensors, tensors_to_messages
from swarm.proto import tensor_pb2

__all__ = [
    "BACKWARD_GROUP",
    "FORWARD_GROUP",
    "GroupMember",
    "GroupRequest",
    "call_backward_group",
    "call_forward_group",
    "error_metadata",
    "parse_group_header",
]

FORWARD_GROUP = "/swarm.moe.Expert/ForwardGroup"
BACKWARD_GROUP = "/swarm.moe.Expert/BackwardGroup"

MAX_GROUP_EXPERTS = 4096
"""The most experts one group call may name."""


@dataclass(frozen=True)
class GroupMember:
    """One expert of a group call.

    Attributes:
        uid: the expert.
        graph_id: as in `swarm.moe.protocol.ExpertCall`.
        rows: strictly increasing int64 indices of its rows among the shared inputs (None: all).
    """

    uid: str
    graph_id: int | None = None
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class GroupRequest:
    """What a group request header says (server side), before any tensor is allocated.

    Attributes:
        members: ``(uid, graph id, has rows)`` per expert, in request order.
        num_inputs: shared input tensors at the head of the bundle.
        header: the parsed bundle header (declared dtypes, shapes, sizes).
    """

    members: tuple[tuple[str, int | None, bool], ...]
    num_inputs: int
    header: tensor_pb2.TensorBundleHeader


def parse_group_header(header_bytes: bytes) -> GroupRequest:
    """Reads a group request's first message.

    Raises:
        InvalidRequest: the header or its metadata is malformed.
    """
    header, metadata = decode_request_header(header_bytes, "group request")
    usage = "group request metadata must be {'inputs': int, 'experts': [{'uid': str, 'graph': int | None, 'rows': bool}]}"
    if not isinstance(metadata, dict) or not isinstance(metadata.get("experts"), list):
        raise InvalidRequest(usage)
    num_inputs = metadata.get("inputs")
    if not isinstance(num_inputs, int) or isinstance(num_inputs, bool) or num_inputs < 1:
        raise InvalidRequest(usage)
    entries = metadata["experts"]
    if not 1 <= len(entries) <= MAX_GROUP_EXPERTS:
        raise InvalidRequest(f"a group request names 1 to {MAX_GROUP_EXPERTS} experts, got {len(entries)}")
    members = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("uid"), str):
            raise InvalidRequest(usage)
        graph_id, rows = entry.get("graph"), entry.get("rows", False)
        if graph_id is not None and (not isinstance(graph_id, int) or isinstance(graph_id, bool)):
            raise InvalidRequest(f"expert request graph id must be an int, got {type(graph_id).__name__}")
        if not isinstance(rows, bool):
            raise InvalidRequest(usage)
        members.append((entry["uid"], graph_id, rows))
    if len({uid for uid, _, _ in members}) != len(members):
        raise InvalidRequest("a group request names an expert twice")
    return GroupRequest(tuple(members), num_inputs, header)


def error_metadata(index: int, error: BaseException) -> dict[str, Any]:
    """The response metadata saying that expert `index` of a group call failed with `error`."""
    code = to_status(error) or grpc.StatusCode.INTERNAL
    return {"expert": index, "status": code.name, "error": str(error)}


def _error_of(metadata: dict[str, Any], peer_id: str, method: str) -> RPCError:
    try:
        code = grpc.StatusCode[metadata.get("status", "UNKNOWN")]
    except KeyError:
        code = grpc.StatusCode.UNKNOWN
    return from_status(code, str(metadata.get("error", "")), peer_id, method)


def _request(
    members: Sequence[GroupMember], inputs: Sequence[torch.Tensor], grads: Sequence[Sequence[torch.Tensor]] = ()
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    tensors = [*inputs, *(g for member_grads in grads for g in member_grads)]
    tensors += [m.rows for m in members if m.rows is not None]
    metadata = {
        "inputs": len(inputs),
        "experts": [{"uid": m.uid, "graph": m.graph_id, "rows": m.rows is not None} for m in members],
    }
    return tensors, metadata


def _member_index(metadata: Any, key: str, count: int) -> int:
    index = metadata.get(key) if isinstance(metadata, dict) else None
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
        raise InvalidRequest(f"malformed group response metadata {metadata!r}")
    return index


async def call_forward_group(
    channel: PeerChannel,
    members: Sequence[GroupMember],
    inputs: Sequence[torch.Tensor],
    on_answer: Callable[[int, list[torch.Tensor] | RPCError], None],
    *,
    timeout: float | None = None,
) -> None:
    """Runs several experts of the server behind `channel` on (shares of) the same inputs.

    Args:
        channel: a channel to the server.
        members: the experts and their shares of the rows.
        inputs: the shared inputs, one tensor per expert argument.
        on_answer: called as each expert answers, in the order they finish, with its index in
            `members` and its outputs, or the `RPCError` saying why it failed.
        timeout: the call's deadline in seconds.

    Raises:
        RPCError: the whole call failed (experts not yet answered got no answer).
    """
    tensors, metadata = _request(members, inputs)
    async with stream_slot(channel, FORWARD_GROUP, timeout) as remaining:
        responses = channel.stream(FORWARD_GROUP, tensors_to_messages(tensors, metadata), remaining)
        async with contextlib.aclosing(responses):
            for _ in range(len(members)):
                outputs, meta = await receive_tensors(responses, MAX_RESPONSE_BYTES)
                index = _member_index(meta, "expert", len(members))
                on_answer(index, _error_of(meta, channel.peer_id, FORWARD_GROUP) if "status" in meta else outputs)


async def call_backward_group(
    channel: PeerChannel,
    members: Sequence[GroupMember],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[Sequence[torch.Tensor]],
    on_error: Callable[[int, RPCError], None],
    *,
    timeout: float | None = None,
) -> tuple[list[int], list[torch.Tensor]]:
    """Sends several experts the gradients of their outputs; they train on them.

    Args:
        channel: a channel to the server.
        members: the experts and their shares of the rows, as in the forward.
        inputs: the shared inputs of the forward.
        grad_outputs: per member, one gradient per output (rows of its share).
        on_error: called with the index and error of each expert that failed.
        timeout: the call's deadline in seconds.

    Returns:
        ``(indices of the experts that answered, gradients w.r.t. the shared inputs summed over
        them)``; the gradients are empty when none answered.

    Raises:
        RPCError: the whole call failed.
    """
    tensors, metadata = _request(members, inputs, grad_outputs)
    async with stream_slot(channel, BACKWARD_GROUP, timeout) as remaining:
        responses = channel.stream(BACKWARD_GROUP, tensors_to_messages(tensors, metadata), remaining)
        async with contextlib.aclosing(responses):
            for _ in range(len(members) + 1):
                grads, meta = await receive_tensors(responses, MAX_RESPONSE_BYTES)
                if isinstance(meta, dict) and "experts" in meta:
                    answered = meta["experts"]
                    if not isinstance(answered, list):
                        raise InvalidRequest(f"malformed group response metadata {meta!r}")
                    return [_member_index({"i": i}, "i", len(members)) for i in answered], grads
                index = _member_index(meta, "expert", len(members))
                on_error(index, _error_of(meta, channel.peer_id, BACKWARD_GROUP))
    raise InvalidRequest(f"{BACKWARD_GROUP} from {channel.peer_id} ended without its gradients")
