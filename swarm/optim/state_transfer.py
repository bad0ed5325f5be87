"""State transfer for training: a peer that falls behind or joins late downloads the swarm's state.

Built on the averaging layer's state transfer (`swarm.averaging.state`: ``/swarm.Averaging/State``,
resumable, one implementation for both): every full peer of a run serves a consistent snapshot of
its `TrainingState` under the run's name (`serve_state`), taken under the optimizer's lock in a
worker thread, so never half an optimizer step. A downloader (`download_state`) takes its
candidates from the progress records (they carry an address and an epoch): the newest epoch is
tried first, and when a provider dies or stalls mid-download the next one is tried, until
`timeout` runs out.

A peer that missed one round while it was in sync (it came a moment late for a group that started
without it) needs only that round's result, not the whole state: the mean gradient the members
applied. A member whose group formed without a peer the round expected keeps a copy of that mean
until its next round lands, and serves it under the run's round-result name
(`serve_round_result`); the late peer downloads it (`download_round_result`) and takes the same
optimizer step the members took, bit for bit (`swarm.Optimizer`, "catching up").
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence

import torch

from swarm.averaging.state import State, StateServer, aload_state_from_peers
from swarm.core.errors import AveragingError, SwarmError
from swarm.dht.handle import PeerHandle
from swarm.optim.progress import PeerProgress
from swarm.optim.training_state import TrainingState

logger = logging.getLogger(__name__)

SnapshotFn = Callable[[], TrainingState]
HeldResultFn = Callable[[], tuple[int, list[torch.Tensor]] | None]


def round_result_name(run_id: str) -> str:
    """The name a run's round results are served under (a space cannot occur in a run id, so it
    never names another run's state)."""
    return f"{run_id} round-result"


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


def serve_round_result(peer: PeerHandle, run_id: str, held: HeldResultFn) -> StateServer:
    """Makes `peer` serve the last round result it keeps: `held()` gives `(epoch, tensors)`, the
    mean applied by the round leading out of `epoch`, or None (then a request fails at once and the
    downloader asks another peer). Served as metadata ``{"epoch": epoch}`` and the tensors."""

    def get_state() -> State:
        kept = held()
        if kept is None:
            raise AveragingError(f"this peer keeps no round result of run {run_id!r}")
        epoch, tensors = kept
        return State({"epoch": epoch}, tensors)

    return StateServer(peer, round_result_name(run_id), get_state, snapshot_ttl=0.0)


async def download_round_result(
    peer: PeerHandle, run_id: str, candidates: Sequence[PeerProgress], epoch: int,
    like: Sequence[torch.Tensor], timeout: float,
) -> tuple[list[torch.Tensor], str]:
    """Downloads the result of the round leading out of `epoch` (the mean its members applied) from
    one of `candidates`, moving on when one fails or holds another round's; returns the tensors and
    the PeerID they came from.

    A result must match `like` (the averaged buffers) tensor for tensor in shape and dtype, and be
    finite: anything else is refused (a peer may lie), and the next candidate is asked.

    Raises:
        StateTransferError: no candidate delivered it in time.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    ordered = [c for c in candidates if c.addr and not c.client_mode and c.peer_id != peer.peer_id]
    random.shuffle(ordered)  # spread the late peers over the members
    size = sum(t.numel() * t.element_size() for t in like)
    errors: list[str] = []
    for candidate in ordered:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            downloaded = await aload_state_from_peers(peer, round_result_name(run_id), [candidate.addr],
                                                      timeout=left, max_bytes=size)
            tensors = _checked_result(downloaded.metadata, downloaded.tensors, epoch, like)
        except (TimeoutError, AveragingError, ValueError, TypeError) as e:
            errors.append(f"{candidate.peer_id[-8:]}: {e}")
            logger.debug("round result download from %s failed: %s", candidate.peer_id, e)
            continue
        return tensors, candidate.peer_id
    reason = "; ".join(errors) if errors else "no member serves it"
    raise StateTransferError(f"could not download the result of round {epoch} of run {run_id!r}: {reason}")


def _checked_result(metadata: object, tensors: Sequence[torch.Tensor], epoch: int,
                    like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The downloaded tensors if they are round `epoch`'s result shaped as `like`; ValueError if not."""
    if not isinstance(metadata, dict) or metadata.get("epoch") != epoch:
        held = metadata.get("epoch") if isinstance(metadata, dict) else None
        raise ValueError(f"holds the result of round {held!r}, not of round {epoch}")
    if len(tensors) != len(like):
        raise ValueError(f"{len(tensors)} tensors, expected {len(like)}")
    for i, (got, want) in enumerate(zip(tensors, like)):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ValueError(f"tensor {i} is {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise ValueError(f"tensor {i} holds NaN or Inf")
    return list(tensors)
