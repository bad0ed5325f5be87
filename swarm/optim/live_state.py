"""A live run's state read from outside it: by `swarm-peer export` (and any peer that trains nothing).

Reads the run's progress records in the DHT (without writing one: a reader is no trainer, and
counting it would change the swarm's batch), picks the newest epoch that peers report, and
downloads the state (`state_transfer.download_state`) from a peer at that epoch whose state
fingerprint is the one most peers there report; a download whose own fingerprint differs is
refused and the next provider asked.
"""

from __future__ import annotations

from swarm.dht.expiring import subkey_entries
from swarm.dht.handle import PeerHandle
from swarm.dht.validation import marker_owner
from swarm.optim.progress import PeerProgress, majority_digest
from swarm.optim.state_transfer import StateTransferError, download_state
from swarm.optim.tracker import progress_key
from swarm.optim.training_state import TrainingState, state_digest


async def aread_progress(peer: PeerHandle, run_id: str) -> list[PeerProgress]:
    """The progress reports of `run_id`'s peers (malformed and foreign ones skipped)."""
    if peer.dht is None:
        raise StateTransferError("this peer has no DHT to find the run in")
    found = await peer.dht.aget(progress_key(run_id), latest=True)
    reports = []
    for subkey, item in subkey_entries(found).items():
        owner = marker_owner(subkey)
        report = PeerProgress.from_record(owner, item.value) if owner is not None else None
        if report is not None:
            reports.append(report)
    return reports


async def download_live_state(peer: PeerHandle, run_id: str, timeout: float) -> TrainingState:
    """The state of the newest epoch of a live run, checked against the majority's fingerprint.

    Raises:
        StateTransferError: no peer reports progress in the run, or none delivered a matching state.
    """
    reports = await aread_progress(peer, run_id)
    if not reports:
        raise StateTransferError(f"no live peer reports progress in run {run_id!r}")
    epoch = max(r.epoch for r in reports)
    expected = majority_digest(reports, epoch)
    candidates = [r for r in reports if r.epoch == epoch and (expected is None or r.digest == expected)]
    state = await download_state(peer, run_id, candidates, timeout, min_epoch=epoch)
    if expected is not None and state.epoch == epoch and state_digest(state.params) != expected:
        raise StateTransferError(f"the state of epoch {epoch} downloaded does not match the fingerprint its peers "
                                 f"report: refused")
    return state
