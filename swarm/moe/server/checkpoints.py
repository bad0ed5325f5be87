"""Expert checkpoints: each expert's module, optimizer and scheduler state in ``<dir>/<uid>.pt``.

Saves are atomic: the state goes to a temporary file in the same directory, is flushed to
disk, then renamed over the old checkpoint (``os.replace``), so a crash mid-save leaves the
previous checkpoint intact. A checkpoint that exists but cannot be read is an error naming the
file; it is never silently replaced by fresh parameters. Whatever makes a save fail (a read-only
directory, a full disk: an `OSError`, or the `RuntimeError` torch raises for a failed write) is
a `CheckpointError`; a `CheckpointSaver` checks at start that it can write its directory, and
counts, logs and remembers failed saves (``swarm_expert_checkpoint_failures_total``), so the
daemon can exit non-zero when the trained updates could not be saved.

File format: ``torch.save`` of ``{"format": 1, "uid": <uid>, "state": backend.state_dict()}``,
read back with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from swarm.core.errors import SwarmError
from swarm.metrics import REGISTRY
from swarm.moe.server.backend import ExpertBackend

__all__ = [
    "CheckpointError", "CheckpointSaver", "check_writable", "checkpoint_path", "load_experts", "save_experts",
]

logger = logging.getLogger(__name__)

_FORMAT = 1
_FAILURES = REGISTRY.counter("swarm_expert_checkpoint_failures_total", "Expert checkpoint saves that failed")
Backends = Mapping[str, ExpertBackend] | Iterable[ExpertBackend]


class CheckpointError(SwarmError):
    """A checkpoint could not be written, or exists but could not be read or applied."""


def _backends(backends: Backends) -> list[ExpertBackend]:
    return list(backends.values()) if isinstance(backends, Mapping) else list(backends)


def checkpoint_path(checkpoint_dir: str | os.PathLike[str], uid: str) -> Path:
    """Returns where the checkpoint of expert `uid` lives.

    Raises:
        ValueError: `uid` cannot be a file name (empty, a path separator, or a leading dot).
    """
    if not uid or uid.startswith(".") or "/" in uid or os.sep in uid or "\0" in uid:
        raise ValueError(f"expert uid {uid!r} cannot name a checkpoint file")
    return Path(checkpoint_dir) / f"{uid}.pt"


def save_expert(backend: ExpertBackend, checkpoint_dir: str | os.PathLike[str]) -> Path:
    """Atomically writes one expert's checkpoint; creates `checkpoint_dir` if needed.

    Returns:
        The checkpoint's path.

    Raises:
        CheckpointError: the file could not be written (the old checkpoint, if any, is kept).
    """
    path = checkpoint_path(checkpoint_dir, backend.name)
    payload = {"format": _FORMAT, "uid": backend.name, "state": backend.state_dict()}
    tmp_name: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False
        ) as tmp:
            tmp_name = tmp.name
            torch.save(payload, tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
        tmp_name = None
        _fsync_dir(path.parent)
    except (OSError, RuntimeError) as e:  # torch reports a failed write (a full disk) as RuntimeError
        raise CheckpointError(f"could not save checkpoint of expert {backend.name} to {path}: {e}") from e
    finally:
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except OSError:
                pass
    return path


def _fsync_dir(directory: Path) -> None:
    # Makes the rename durable; not possible on every platform, and not needed for atomicity.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_writable(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Creates `checkpoint_dir` if needed and checks that a file can be written in it.

    Raises:
        CheckpointError: it cannot be created or written, with the reason.
    """
    directory = Path(checkpoint_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check.", suffix=".tmp"):
            pass
    except OSError as e:
        raise CheckpointError(f"checkpoint directory {directory} is not writable: {e.strerror or e}") from e


def save_experts(backends: Backends, checkpoint_dir: str | os.PathLike[str]) -> list[Path]:
    """Atomically writes the checkpoint of every expert.

    Args:
        backends: the experts, as a ``{uid: backend}`` mapping or an iterable of backends.
        checkpoint_dir: the directory; created if needed.

    Returns:
        The paths written, in the order of `backends`.

    Raises:
        CheckpointError: a file could not be written (experts before it are saved).
    """
    return [save_expert(backend, checkpoint_dir) for backend in _backends(backends)]


def load_expert(backend: ExpertBackend, checkpoint_dir: str | os.PathLike[str]) -> bool:
    """Restores one expert from its checkpoint, if it has one.

    Returns:
        True if a checkpoint was loaded, False if none exists (the expert keeps its state).

    Raises:
        CheckpointError: the file exists but is unreadable, corrupt, for another expert, or
            does not fit this expert; the message names the file, the expert is unchanged.
    """
    path = checkpoint_path(checkpoint_dir, backend.name)
    if not path.exists():
        return False
    try:
        payload: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} of expert {backend.name} is unreadable or corrupt: {e}"
        ) from e
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT or "state" not in payload:
        raise CheckpointError(f"checkpoint {path} is not a swarm expert checkpoint (format {_FORMAT})")
    if payload.get("uid") != backend.name:
        raise CheckpointError(f"checkpoint {path} holds expert {payload.get('uid')!r}, not {backend.name!r}")
    try:
        backend.load_state_dict(payload["state"])
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path} does not fit expert {backend.name}: {e}") from e
    return True


def load_experts(backends: Backends, checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Restores every expert that has a checkpoint in `checkpoint_dir`.

    Call it before the runtime starts serving the experts.

    Args:
        backends: the experts, as a ``{uid: backend}`` mapping or an iterable of backends.
        checkpoint_dir: the directory; a missing directory means no checkpoints.

    Returns:
        The UIDs of the experts that were restored.

    Raises:
        CheckpointError: a checkpoint file exists but cannot be applied (see `load_expert`).
    """
    return [b.name for b in _backends(backends) if load_expert(b, checkpoint_dir)]


class CheckpointSaver:
    """Saves a server's experts on demand and, optionally, every `interval` seconds.

    Saving takes a consistent snapshot of each expert (`ExpertBackend.state_dict`), so it may
    run on its own thread while the runtime trains the experts.

    Args:
        backends: the experts, as a ``{uid: backend}`` mapping or an iterable of backends.
        checkpoint_dir: where checkpoints live.
        interval: seconds between periodic saves by `start`'s thread; None for no thread.
        on_save: called with the paths after each complete save (e.g. for metrics).
    """

    def __init__(
        self,
        backends: Backends,
        checkpoint_dir: str | os.PathLike[str],
        interval: float | None = None,
        on_save: Callable[[list[Path]], None] | None = None,
    ) -> None:
        if interval is not None and not interval > 0:
            raise ValueError(f"interval must be positive or None, got {interval!r}")
        self.backends = _backends(backends)
        self.checkpoint_dir = Path(checkpoint_dir)
        self.interval = interval
        self.on_save = on_save
        self.saves = 0
        """How many complete saves have finished."""
        self.failures = 0
        """How many saves failed."""
        self.last_error: CheckpointError | None = None
        """Why the last save failed, until a later save of every expert succeeds (None: all saved)."""
        self._saved_updates: dict[str, int] = {}  # what is on disk: each expert's update count
        self._save_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check_writable(self) -> None:
        """Checks that checkpoints can be written (see `check_writable`); raises `CheckpointError`."""
        check_writable(self.checkpoint_dir)

    def load(self) -> list[str]:
        """Restores the experts that have checkpoints; returns their UIDs (see `load_experts`)."""
        restored = load_experts(self.backends, self.checkpoint_dir)
        for backend in self.backends:
            if backend.name in restored:
                self._saved_updates[backend.name] = backend.updates
        return restored

    def save(self, only_changed: bool = False) -> list[Path]:
        """Saves every expert now; returns the paths written (see `save_experts`).

        Args:
            only_changed: skip experts that took no optimizer step since they were last saved
                or loaded by this saver (an expert with 16 GB of Adam state is not rewritten
                every period while nobody trains it).
        """
        with self._save_lock:  # the periodic thread and a final save never interleave
            paths = []
            try:
                for backend in self.backends:
                    updates = backend.updates
                    if only_changed and self._saved_updates.get(backend.name) == updates:
                        continue
                    paths.append(save_expert(backend, self.checkpoint_dir))
                    self._saved_updates[backend.name] = updates
            except CheckpointError as e:
                self.failures += 1
                self.last_error = e
                _FAILURES.inc()
                raise
            self.last_error = None
            self.saves += 1
        if self.on_save is not None:
            self.on_save(paths)
        return paths

    def start(self) -> None:
        """Starts the periodic saving thread.

        Raises:
            RuntimeError: no interval was given, or the thread was already started.
        """
        if self.interval is None:
            raise RuntimeError("CheckpointSaver.start needs an interval")
        if self._thread is not None:
            raise RuntimeError("CheckpointSaver already started")
        self._thread = threading.Thread(
            target=self._run, args=(self.interval,), name="swarm-moe-checkpoints", daemon=True
        )
        self._thread.start()

    def stop(self, final_save: bool = True, timeout: float = 30.0) -> None:
        """Stops the periodic thread (if any) and, by default, saves what changed one last time.

        Raises:
            CheckpointError: the final save failed.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if final_save:
            self.save(only_changed=True)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.save(only_changed=True)
            except Exception:  # keep trying on the next tick; the next save may succeed
                logger.exception("periodic checkpoint of %d experts failed", len(self.backends))
