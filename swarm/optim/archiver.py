"""An archiver: a peer that trains nothing and keeps a run's state on disk (`swarm-peer --archive DIR --run RUN_ID`).

Every `ArchiverConfig.every_seconds` it downloads the run's state from its live peers, checked
against the fingerprint most peers at the newest epoch report (`swarm.optim.live_state`: a
provider whose state differs is refused), and saves it as a checkpoint of the run
(`swarm.checkpoint.CheckpointStore`: atomic, the last `keep` kept), unless that epoch is saved
already. The parameters are named ``param.<i>`` in the optimizer's order (the wire carries no
names). A trainer that finds no live peer resumes from that directory (`resume_from=DIR`).
A download or a save that fails is logged and counted (``swarm_archive_saves_total{outcome}``)
and the archiver tries again at its next turn.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from swarm.checkpoint.store import CheckpointStore
from swarm.core.errors import ConfigError, SwarmError
from swarm.dht.handle import PeerHandle
from swarm.optim.checkpointing import param_specs, state_to_checkpoint
from swarm.optim.live_state import download_live_state

logger = logging.getLogger(__name__)


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
        while not stop.is_set():
            self.archive_once()
            stop.wait(self.config.every_seconds)

    def start(self, stop: threading.Event) -> threading.Thread:
        """Runs `run(stop)` in a daemon thread of its own."""
        thread = threading.Thread(target=self.run, args=(stop,), daemon=True, name=f"archiver-{self.config.run_id}")
        thread.start()
        return thread
