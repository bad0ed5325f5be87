"""State transfer for training: a peer that falls behind or joins late downloads the swarm's state.

Built on the averaging layer's state transfer (`swarm.averaging.state`: ``/swarm.Averaging/State``,
resumable, one implementation for both): every full peer of a run serves a consistent snapshot of
its `TrainingState` under the run's name (`serve_state`), taken under the optimizer's lock in a
worker thread, so never half an optimizer step. A downloader (`download_state`) takes its
candidates from the progress records (they carry an address and an epoch): the newest epoch is
tried first, and when a provider dies or stalls mid-download the next one is tried, until
`timeout` runs out.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence

from swarm.averaging.state import State, StateServer, aload_state_from_peers
from swarm.core.errors import AveragingError, SwarmError
from swarm.dht.handle import PeerHandle
from swarm.optim.progress import PeerProgress
from swarm.optim.training_state import TrainingState

logger = logging.getLogger(__name__)

SnapshotFn = Callable[[], TrainingState]


class StateTransferError(SwarmError):
    """No provider could deliver the training state in time."""


def serve_state(peer: PeerHandle, run_id: str, snapshot: SnapshotFn) -> StateServer:
    """Makes `peer` serve the state of `run_id`, `snapshot()` taken in a worker thread on each request.

    The server stops with the peer, or with ``await server.ashutdown()``.

    Raises:
        ConfigError: The peer is in client mode (it serves nothing).
    """

    def get_state() -> State:
        tensors, metadata = snapshot().to_wire()
        return State(metadata, tensors)

    # every request gets a fresh snapshot: the state moves on with each step
    return StateServer(peer, run_id, get_state, snapshot_ttl=0.0)


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
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    ordered = [c for c in candidates if c.addr and not c.client_mode and c.peer_id != peer.peer_id]
    random.shuffle(ordered)  # spread newcomers over providers
    ordered.sort(key=lambda c: -c.epoch)
    errors: list[str] = []
    for candidate in ordered:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            downloaded = await aload_state_from_peers(peer, run_id, [candidate.addr], timeout=left)
            state = TrainingState.from_wire(downloaded.tensors, downloaded.metadata)
        except (TimeoutError, AveragingError, ValueError, TypeError) as e:
            errors.append(f"{candidate.peer_id[-8:]}: {e}")
            logger.debug("state download from %s failed: %s", candidate.peer_id, e)
            continue
        if state.epoch < min_epoch:
            errors.append(f"{candidate.peer_id[-8:]}: epoch {state.epoch} < {min_epoch}")
            continue
        return state
    reason = "; ".join(errors) if errors else "no peer serves it"
    raise StateTransferError(f"could not download the state of run {run_id!r}: {reason}")
