"""State transfer: a peer that falls behind or joins late downloads the swarm's training state.

Server side (`rpc_get_state`): every full peer of a run serves a consistent snapshot of its
`TrainingState` (taken under the optimizer's lock, so never half an optimizer step) as one
tensor stream: a header, then raw ~1 MiB chunks (swarm.net.streaming). Client side
(`call_get_state` / `download_state`): candidates come from the progress records (they carry
an address and an epoch); the newest epoch is tried first, and when a provider dies or stalls
mid-download the next one is tried, until `timeout` runs out.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence

from swarm.core.errors import ConfigError, InvalidRequest, NotFound, RPCError, SwarmError
from swarm.core.serialization import pack, unpack
from swarm.dht.handle import PeerHandle
from swarm.net.handle import NetworkHandle
from swarm.net.server import CallContext, RPCServer
from swarm.net.streaming import receive_tensors, tensors_to_messages
from swarm.optim.progress import PeerProgress
from swarm.optim.training_state import TrainingState

logger = logging.getLogger(__name__)

GET_STATE = "/swarm.Optim/GetState"

SnapshotFn = Callable[[], "TrainingState | None"]


class StateTransferError(SwarmError):
    """No provider could deliver the training state in time."""


class StateService:
    """The training states one peer serves, one snapshot function per run (kept in `peer.services`).

    Several optimizers may share a peer; one ``GetState`` handler dispatches to the run asked for.
    """

    def __init__(self, server: RPCServer) -> None:
        self.providers: dict[str, SnapshotFn] = {}
        server.add_stream(GET_STATE, self.rpc_get_state, request_streaming=False, bulk=True)

    async def rpc_get_state(self, requests: AsyncIterator[bytes], ctx: CallContext) -> AsyncIterator[bytes]:
        request = None
        async for message in requests:
            request = message
        try:
            run_id = unpack(request or b"", max_bytes=4096)["run_id"]
        except (ValueError, TypeError, KeyError) as e:
            raise InvalidRequest(f"malformed state request: {e}") from None
        snapshot = self.providers.get(run_id) if isinstance(run_id, str) else None
        if snapshot is None:
            raise NotFound(f"this peer does not train run {run_id!r}")
        state = await asyncio.to_thread(snapshot)
        if state is None:
            raise NotFound(f"this peer has no state for run {run_id!r} yet")
        tensors, metadata = state.to_wire()
        logger.debug("sending state of epoch %d to %s", state.epoch, ctx.peer_id)
        for message in tensors_to_messages(tensors, metadata):
            yield message


def serve_state(peer: NetworkHandle, run_id: str, snapshot: SnapshotFn) -> None:
    """Makes `peer` answer state requests for `run_id` with `snapshot()` (called in a worker thread).

    Raises:
        ConfigError: The peer is in client mode (it serves nothing).
    """
    server = peer.server
    if server is None:
        raise ConfigError("a client-mode peer serves no state")
    peer.services.get_or_create(StateService, lambda: StateService(server)).providers[run_id] = snapshot


def stop_serving_state(peer: NetworkHandle, run_id: str) -> None:
    service = peer.services.get(StateService)
    if service is not None:
        service.providers.pop(run_id, None)


async def call_get_state(peer: PeerHandle, addr: str, run_id: str, timeout: float) -> TrainingState:
    """Downloads the state of `run_id` from the peer at `addr`; raises `RPCError`, ValueError or TypeError."""
    channel = peer.pool.get(addr)
    stream = channel.stream(GET_STATE, [pack({"run_id": run_id})], timeout=timeout, bulk=True)
    try:
        tensors, metadata = await receive_tensors(stream)
    finally:
        await stream.aclose()
    return TrainingState.from_wire(tensors, metadata)


async def download_state(
    peer: PeerHandle, run_id: str, candidates: Sequence[PeerProgress], timeout: float, min_epoch: int = 0,
) -> TrainingState:
    """Downloads the newest state among `candidates`, moving on when one fails.

    Args:
        peer: the downloading `swarm.Peer`.
        run_id: the training run.
        candidates: progress reports of peers that may hold the state (client-mode ones are skipped).
        timeout: seconds for the whole download, all attempts together.
        min_epoch: refuse states older than this.

    Raises:
        StateTransferError: no candidate delivered a state of at least `min_epoch` in time.
    """
    deadline = time.monotonic() + timeout
    ordered = [c for c in candidates if c.addr and not c.client_mode and c.peer_id != peer.peer_id]
    random.shuffle(ordered)  # spread newcomers over providers
    ordered.sort(key=lambda c: -c.epoch)
    errors: list[str] = []
    for candidate in ordered:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            state = await call_get_state(peer, candidate.addr, run_id, left)
        except (TimeoutError, RPCError, ValueError) as e:
            errors.append(f"{candidate.peer_id[-8:]}: {e}")
            logger.debug("state download from %s failed: %s", candidate.peer_id, e)
            continue
        if state.epoch < min_epoch:
            errors.append(f"{candidate.peer_id[-8:]}: epoch {state.epoch} < {min_epoch}")
            continue
        return state
    reason = "; ".join(errors) if errors else "no peer serves it"
    raise StateTransferError(f"could not download the state of run {run_id!r}: {reason}")
