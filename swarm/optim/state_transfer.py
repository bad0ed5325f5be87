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
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

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

    async def fetch(addr: str, left: float) -> TrainingState:
        downloaded = await aload_state_from_peers(peer, run_id, [addr], timeout=left)
        state = TrainingState.from_wire(downloaded.tensors, downloaded.metadata)
        if state.epoch < min_epoch:
            raise ValueError(f"epoch {state.epoch} < {min_epoch}")
        return state

    providers = _providers(peer, candidates)
    providers.sort(key=lambda c: -c.epoch)  # the newest first
    state, _ = await _first_delivered(providers, timeout, fetch, f"the state of run {run_id!r}", "no peer serves it")
    return state


T = TypeVar("T")


def _providers(peer: PeerHandle, candidates: Sequence[PeerProgress]) -> list[PeerProgress]:
    """The candidates that serve (not client mode, not this peer), shuffled to spread the askers."""
    ordered = [c for c in candidates if c.addr and not c.client_mode and c.peer_id != peer.peer_id]
    random.shuffle(ordered)
    return ordered


async def _first_delivered(providers: Sequence[PeerProgress], timeout: float,
                           fetch: Callable[[str, float], Awaitable[T]], what: str, none: str) -> tuple[T, str]:
    """`fetch(addr, seconds_left)` from each provider in turn until one delivers, all within `timeout`;
    returns what it delivered and its PeerID. A provider that fails, stalls or delivers something
    `fetch` refuses (ValueError, TypeError) is logged and the next one asked.

    Raises:
        StateTransferError: none delivered in time (`what` names the download, `none` says why
        when there was no provider).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    errors: list[str] = []
    for provider in providers:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            return await fetch(provider.addr, left), provider.peer_id
        except (TimeoutError, AveragingError, ValueError, TypeError) as e:
            errors.append(f"{provider.peer_id[-8:]}: {e}")
            logger.debug("download of %s from %s failed: %s", what, provider.peer_id, e)
    raise StateTransferError(f"could not download {what}: {'; '.join(errors) if errors else none}")


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
    size = sum(t.numel() * t.element_size() for t in like)

    async def fetch(addr: str, left: float) -> list[torch.Tensor]:
        downloaded = await aload_state_from_peers(peer, round_result_name(run_id), [addr], timeout=left,
                                                  max_bytes=size)
        return _checked_result(downloaded.metadata, downloaded.tensors, epoch, like)

    return await _first_delivered(_providers(peer, candidates), timeout, fetch,
                                  f"the result of round {epoch} of run {run_id!r}", "no member serves it")


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
