"""An archiver: a peer that trains nothing and keeps a run's state on disk (`swarm-peer --archive DIR --run RUN_ID`).

Every `ArchiverConfig.every_seconds` it downloads the run's state from its live peers, checked
against the fingerprint most peers at the newest epoch report (`swarm.optim.live_state`: a
provider whose state differs is refused), and saves it as a checkpoint of the run
(`swarm.checkpoint.CheckpointStore`: atomic, the last `keep` kept), unless that epoch is saved
already. The parameters are named ``param.<i>`` in the optimizer's order (the wire carries no
names). A download or a save that fails is logged and counted
(``swarm_archive_saves_total{outcome}``) and the archiver tries again at its next turn.

An archiver that accepts connections serves its newest intact checkpoint over state transfer
under the run's archive name (`archive_name`) and announces in the DHT, in a record only it can
sign (subkey: its owner marker), its address and the epochs it holds (``{run_id}.archives``):
when it starts, and after each turn.

A trainer that finds no live peer resumes (`load_cold_state`) from a directory of checkpoints
(`resume_from=DIR`), from an archiver it names by multiaddr, PeerID included
(`resume_from="/ip4/.../p2p/<PeerID>"`), or from archivers it names by PeerID alone
(`resume_from="<PeerID>[,<PeerID>...]"`): it reads the run's announcements in the DHT, keeps
those signed by the PeerIDs named, and downloads from the one announcing the newest epoch (the
next on failure), dialling the announced address with that PeerID, which the connection proves.
An archiver the user did not name is never used: anyone can run one and announce any epoch,
and with no live peer left nothing can tell its state from a forgery (docs/threat-model.md).
A state whose fingerprint differs from the one most live peers at its epoch report is refused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.averaging.state import State, StateServer, aload_state_from_peers
from swarm.checkpoint.errors import RunCheckpointError
from swarm.checkpoint.store import CheckpointStore
from swarm.core.errors import AveragingError, ConfigError, SwarmError
from swarm.core.identity import IdentityError, peer_id_to_public_key
from swarm.core.timeutil import get_dht_time
from swarm.dht.expiring import ValueWithExpiration
from swarm.dht.handle import PeerHandle
from swarm.dht.validation import marker_owner, owner_marker
from swarm.optim.checkpointing import (
    Checkpointer,
    checkpoint_to_state,
    param_specs,
    resume_state,
    state_to_checkpoint,
)
from swarm.optim.live_state import download_live_state
from swarm.optim.progress import PeerProgress, majority_digest
from swarm.optim.state_transfer import StateTransferError
from swarm.optim.training_state import TrainingState, state_digest

logger = logging.getLogger(__name__)

MAX_ANNOUNCED_EPOCHS = 64
"""The most epochs an announcement lists (an archiver keeps a few; a longer list is malformed)."""


def archive_name(run_id: str) -> str:
    """The name an archiver serves a run's state under (a space never occurs in a run id)."""
    return f"{run_id} archive"


def archives_key(run_id: str) -> str:
    """The DHT key under which archivers of a run announce the epochs they hold."""
    return f"{run_id}.archives"


def is_peer_address(source: str) -> bool:
    """Whether `resume_from` names a peer (a multiaddr with its PeerID) rather than a directory."""
    return source.startswith(("/ip4/", "/ip6/", "/dns")) and "/p2p/" in source


def trusted_archivers(source: str) -> tuple[str, ...] | None:
    """The PeerIDs `resume_from` names (one, or several separated by commas), or None when it is
    not a list of Ed25519 PeerIDs (or names a path that exists: a directory wins)."""
    if not source or Path(source).exists():
        return None
    ids = tuple(part.strip() for part in source.split(","))
    for peer_id in ids:
        try:
            peer_id_to_public_key(peer_id)
        except (IdentityError, ValueError):
            return None
    return ids


@dataclass(frozen=True)
class ArchiverAnnouncement:
    """What an archiver announces in the DHT: who it is (the record's signer), where it listens and
    the epochs it holds, newest first."""

    peer_id: str
    addr: str
    epochs: tuple[int, ...]

    @classmethod
    def from_record(cls, peer_id: str, value: object) -> ArchiverAnnouncement | None:
        """The announcement signed by `peer_id`, or None when malformed (an address that is not
        this signer's, epochs that are not a short list of non-negative integers)."""
        if not isinstance(value, dict):
            return None
        addr, epochs = value.get("addr"), value.get("epochs")
        if not isinstance(addr, str) or not is_peer_address(addr) or not addr.endswith(f"/p2p/{peer_id}"):
            return None
        if not isinstance(epochs, list) or not 0 < len(epochs) <= MAX_ANNOUNCED_EPOCHS or not all(
                isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in epochs):
            return None
        return cls(peer_id, addr, tuple(sorted(epochs, reverse=True)))

    @property
    def newest(self) -> int:
        return self.epochs[0]


async def afind_archivers(peer: PeerHandle, run_id: str) -> list[ArchiverAnnouncement]:
    """The archivers of `run_id` announced in the DHT, newest epoch first (malformed ones skipped)."""
    if peer.dht is None:
        return []
    found = await peer.dht.aget(archives_key(run_id), latest=True)
    value = found.value if found is not None else None
    announcements = []
    if isinstance(value, dict):
        for subkey, item in value.items():
            owner = marker_owner(subkey)  # signed by that peer; other subkeys anyone may write
            if owner is None or not isinstance(item, ValueWithExpiration):
                continue
            announcement = ArchiverAnnouncement.from_record(owner, item.value)
            if announcement is not None:
                announcements.append(announcement)
    return sorted(announcements, key=lambda a: a.newest, reverse=True)


@dataclass(frozen=True)
class ArchiverConfig:
    """What an archiver keeps and how often.

    Attributes:
        directory: where the checkpoints go.
        run_id: the run.
        every_seconds: seconds between downloads.
        keep: how many of the newest checkpoints stay.
        timeout: seconds a download may take.
    """

    directory: str | Path
    run_id: str
    every_seconds: float = 300.0
    keep: int = 3
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if not self.run_id or any(c.isspace() for c in self.run_id):
            raise ConfigError(f"--run must be a run id without spaces, got {self.run_id!r}")
        if not self.every_seconds > 0 or not self.timeout > 0:
            raise ConfigError("the archive's interval and timeout must be positive")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"keep must be a positive integer, got {self.keep!r}")


class Archiver:
    """Keeps the state of `config.run_id` in `config.directory` (see the module doc).

    Args:
        peer: the `swarm.Peer` it downloads through (client mode is fine).
        config: what to keep and how often.
    """

    def __init__(self, peer: PeerHandle, config: ArchiverConfig) -> None:
        self.peer = peer
        self.config = config
        self.store = CheckpointStore(config.directory, keep=config.keep)
        self.last_error: str | None = None
        self.server = StateServer(peer, archive_name(config.run_id), self._newest, snapshot_ttl=config.every_seconds
                                  ) if peer.server is not None else None

    def _newest(self) -> State:
        """The state served: the newest intact checkpoint (in a worker thread of the loop)."""
        try:
            checkpoint = self.store.load_newest(self.config.run_id)
        except RunCheckpointError as e:
            raise AveragingError(f"this archiver holds no state of run {self.config.run_id!r}: {e}") from None
        tensors, metadata = checkpoint_to_state(checkpoint).to_wire()
        return State(metadata, tensors)

    async def _announce(self) -> None:
        dht = self.peer.dht
        epochs = self.store.epochs()[:MAX_ANNOUNCED_EPOCHS]
        if dht is None or self.server is None or not self.peer.addrs or not epochs:
            return
        record = {"addr": self.peer.addrs[0], "epochs": epochs}
        stored = await dht.astore(archives_key(self.config.run_id), record,
                                  get_dht_time() + 2 * self.config.every_seconds + 60,
                                  subkey=owner_marker(self.peer.peer_id))
        if stored:
            logger.info("[%s] announced the archive of epochs %s", self.config.run_id, epochs)

    def announce(self) -> None:
        """Announces the epochs held in the DHT (logged when it fails)."""
        try:
            self.peer.run(self._announce(), timeout=30)
        except (SwarmError, TimeoutError, RuntimeError, OSError) as e:
            logger.warning("[%s] could not announce the archive: %s", self.config.run_id, e)

    def archive_once(self) -> int | None:
        """Downloads the run's state and saves it if its epoch is new; returns the epoch saved or
        already held, None when it failed (logged)."""
        from swarm.metrics import REGISTRY

        saves = REGISTRY.counter("swarm_archive_saves_total", "An archiver's saves of a run's state", ("outcome",))
        cfg = self.config
        started = time.monotonic()
        try:
            state = self.peer.run(download_live_state(self.peer, cfg.run_id, cfg.timeout), timeout=cfg.timeout + 10)
        except (SwarmError, TimeoutError, RuntimeError) as e:  # RuntimeError: the peer shut down meanwhile
            self.last_error = str(e)
            saves.labels(outcome="failed").inc()
            logger.warning("[%s] could not download the run's state to archive: %s", cfg.run_id, e)
            return None
        held = self.store.epochs()
        if held and held[0] >= state.epoch:
            logger.info("[%s] epoch %d is archived already", cfg.run_id, state.epoch)
            return state.epoch
        try:
            params, tree, tensors = state_to_checkpoint(state, param_specs(state.params, None))
            path = self.store.save(cfg.run_id, state.epoch, 0, params, tree, tensors,
                                   {"archived_by": self.peer.peer_id})
        except OSError as e:
            self.last_error = str(e)
            saves.labels(outcome="failed").inc()
            logger.error("[%s] could not save the archive of epoch %d: %s; the earlier ones are kept", cfg.run_id,
                         state.epoch, e)
            return None
        self.last_error = None
        saves.labels(outcome="succeeded").inc()
        logger.info("[%s] archived epoch %d in %.2f s (%s)", cfg.run_id, state.epoch, time.monotonic() - started, path)
        return state.epoch

    def run(self, stop: threading.Event) -> None:
        """Archives now and then every `every_seconds` until `stop` is set."""
        self.announce()  # what it holds from before (a restarted archiver serves at once)
        while not stop.is_set():
            self.archive_once()
            self.announce()
            stop.wait(self.config.every_seconds)

    def start(self, stop: threading.Event) -> threading.Thread:
        """Runs `run(stop)` in a daemon thread of its own."""
        thread = threading.Thread(target=self.run, args=(stop,), daemon=True, name=f"archiver-{self.config.run_id}")
        thread.start()
        return thread


def resume_from_archiver(peer: PeerHandle, run_id: str, addr: str, params: Sequence[torch.Tensor], at_least: int,
                         reports: Sequence[PeerProgress], timeout: float) -> TrainingState | None:
    """The state of a cold restart from the archiver at `addr`, if its epoch is at least `at_least`
    (else None, logged: live peers hold as much).

    Raises:
        StateTransferError: the archiver did not deliver it, it is of another model, or its
            fingerprint differs from the one most live peers at its epoch report.
    """
    try:
        downloaded = peer.run(aload_state_from_peers(peer, archive_name(run_id), [addr], timeout=timeout),
                              timeout=timeout + 5)
        state = TrainingState.from_wire(downloaded.tensors, downloaded.metadata)
        state.check_compatible(params)
    except (AveragingError, TimeoutError, ValueError, TypeError) as e:
        raise StateTransferError(f"could not resume run {run_id!r} from the archiver {addr}: {e}") from None
    if state.epoch < at_least:
        logger.info("[%s] not resuming from the archiver's epoch %d: live peers hold epoch %d or later", run_id,
                    state.epoch, at_least - 1)
        return None
    expected = majority_digest(reports, state.epoch)
    if expected is not None and state_digest(state.params) != expected:
        raise StateTransferError(f"the archiver {addr} serves a state of epoch {state.epoch} that the live peers at "
                                 f"that epoch do not hold: refused")
    logger.info("[%s] resuming from the archiver %s (epoch %d)", run_id, addr, state.epoch)
    return state


def resume_from_trusted_archivers(peer: PeerHandle, run_id: str, trusted: Sequence[str],
                                  params: Sequence[torch.Tensor], at_least: int, reports: Sequence[PeerProgress],
                                  timeout: float) -> TrainingState | None:
    """The state of a cold restart from the archivers whose PeerIDs are in `trusted`, found through
    their announcements in the DHT: the one announcing the newest epoch first, the next when it
    fails. None (logged) when none of them announces an epoch of at least `at_least`.

    Raises:
        StateTransferError: none of those announced delivered a state that passed
            `resume_from_archiver`'s checks (each failure is in the message).
    """
    try:
        found = peer.run(afind_archivers(peer, run_id), timeout=timeout)
    except (SwarmError, TimeoutError) as e:
        logger.warning("[%s] could not read the run's archivers from the DHT: %s", run_id, e)
        return None
    candidates = [a for a in found if a.peer_id in trusted and a.newest >= at_least]
    if not candidates:
        logger.warning("[%s] none of the archivers named (%s) announces an epoch of at least %d (announced: %s)",
                       run_id, ", ".join(trusted), at_least, {a.peer_id: a.newest for a in found} or "none")
        return None
    failures = []
    for announcement in candidates:
        logger.info("[%s] the archiver %s announces epochs %s at %s", run_id, announcement.peer_id,
                    list(announcement.epochs), announcement.addr)
        try:
            return resume_from_archiver(peer, run_id, announcement.addr, params, at_least, reports, timeout)
        except StateTransferError as e:  # unreachable, or its state refused: another named one may do
            logger.warning("[%s] %s", run_id, e)
            failures.append(str(e))
    raise StateTransferError(f"no archiver named delivered run {run_id!r}'s state: {'; '.join(failures)}")


def load_cold_state(peer: PeerHandle, run_id: str, source: str, params: Sequence[torch.Tensor],
                    checkpointer: Checkpointer | None, at_least: int, reports: Sequence[PeerProgress],
                    timeout: float) -> TrainingState | None:
    """The state of a cold restart from `resume_from`'s `source`: an archiver's multiaddr with its
    PeerID, archivers' PeerIDs found through the DHT, or a directory of checkpoints; None (logged)
    when it holds nothing newer than `at_least - 1`.

    Raises:
        StateTransferError: an archiver's state was refused (see `resume_from_archiver`).
        CheckpointRefused: the directory's newest checkpoint is another run's or model's.
    """
    if is_peer_address(source):
        return resume_from_archiver(peer, run_id, source, params, at_least, reports, timeout)
    trusted = trusted_archivers(source)
    if trusted is not None:
        return resume_from_trusted_archivers(peer, run_id, trusted, params, at_least, reports, timeout)
    return resume_state(Path(source), run_id, params, checkpointer, at_least)
