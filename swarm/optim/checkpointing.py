"""A trainer's checkpoints: its `TrainingState` saved on a schedule, and a cold restart from them.

`Checkpointer` is what `swarm.Optimizer(..., checkpoint_dir=...)` runs: after a collective step
that makes one due (every `CheckpointConfig.every_epochs` epochs, or `every_seconds` seconds),
the optimizer takes a snapshot under its lock (a copy of the tensors: the only time the trainer
waits) and a thread of the checkpointer's own writes it (`swarm.checkpoint.CheckpointStore`:
temporary name, fsync, rename, the last K kept). One save at a time: a save that comes due
while the last one is still writing is skipped, not queued. A save that fails (disk full,
permission denied) logs an error, counts in ``swarm_checkpoint_saves_total{outcome="failed"}``
and training goes on; the earlier checkpoints stay as they were.

`load_resume_state` is the cold restart's read: the newest checkpoint of the run in a directory
that verifies (a damaged newest one is skipped for the one before), as a `TrainingState`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.checkpoint.errors import CheckpointInvalid, CheckpointNotFound
from swarm.checkpoint.format import ParamSpec, RawTensor
from swarm.checkpoint.store import Checkpoint, CheckpointStore
from swarm.core.errors import ConfigError
from swarm.optim.training_state import TrainingState, join_tensors, split_tensors

logger = logging.getLogger(__name__)

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def to_raw(tensor: torch.Tensor) -> RawTensor:
    """A CPU copy-free view of `tensor`'s bytes (copied only if not contiguous or not on the CPU)."""
    name = DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError(f"a checkpoint cannot hold a {tensor.dtype} tensor")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")
    return RawTensor(name, tuple(tensor.shape), data)


def from_raw(raw: RawTensor) -> torch.Tensor:
    """A tensor over `raw`'s bytes (copied once if they are read-only)."""
    dtype = TORCH_DTYPES.get(raw.dtype)
    if dtype is None:
        raise TypeError(f"this swarm cannot load a {raw.dtype} tensor into torch")
    data = raw.data
    if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
        data = bytearray(data)
    if not memoryview(data).nbytes:
        return torch.empty(raw.shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(raw.shape)


def param_specs(params: Sequence[torch.Tensor], names: Sequence[str] | None) -> list[ParamSpec]:
    """Each parameter's name (``param.<i>`` unless named), safetensors dtype and shape."""
    if names is not None and len(names) != len(params):
        raise ConfigError(f"{len(names)} parameter names for {len(params)} parameters")
    specs = []
    for i, p in enumerate(params):
        dtype = DTYPE_NAMES.get(p.dtype)
        if dtype is None:
            raise ConfigError(f"parameter {i} is {p.dtype}: a checkpoint cannot hold it")
        specs.append(ParamSpec(names[i] if names is not None else f"param.{i}", dtype, tuple(p.shape)))
    if len({s.name for s in specs}) != len(specs):
        raise ConfigError("parameter names must be distinct")
    return specs


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often a trainer saves the run's state.

    Attributes:
        directory: where checkpoints go (created if missing).
        every_epochs: save after every this many collective steps (None: by time only).
        every_seconds: save when this many seconds passed since the last save (None: by epochs only).
        keep: how many of the newest checkpoints stay on disk.
        param_names: the parameters' names in the files (default ``param.<i>``); give the model's
            ``named_parameters()`` names to export a file ``load_state_dict`` takes as it is.
        extra: called at each save; its JSON-able mapping is kept in the manifest (the demo keeps
            its loss curve there).
    """

    directory: str | Path
    every_epochs: int | None = 1
    every_seconds: float | None = None
    keep: int = 3
    param_names: tuple[str, ...] | None = None
    extra: Callable[[], Mapping[str, object]] | None = None

    def __post_init__(self) -> None:
        if self.every_epochs is not None and (not isinstance(self.every_epochs, int) or self.every_epochs < 1):
            raise ConfigError(f"every_epochs must be a positive integer or None, got {self.every_epochs!r}")
        if self.every_seconds is not None and not self.every_seconds > 0:
            raise ConfigError(f"every_seconds must be positive or None, got {self.every_seconds!r}")
        if self.every_epochs is None and self.every_seconds is None:
            raise ConfigError("set every_epochs or every_seconds")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"keep must be a positive integer, got {self.keep!r}")


def state_to_checkpoint(state: TrainingState, specs: Sequence[ParamSpec]
                        ) -> tuple[list[tuple[str, RawTensor]], object, list[RawTensor]]:
    """`state` as a store saves it: the named parameters, the state tree, the state's tensors."""
    state_tensors: list[torch.Tensor] = []
    tree = split_tensors({"optimizer": state.optimizer, "scheduler": state.scheduler}, state_tensors)
    params = [(spec.name, to_raw(p)) for spec, p in zip(specs, state.params)]
    return params, tree, [to_raw(t) for t in state_tensors]


def checkpoint_to_state(checkpoint: Checkpoint) -> TrainingState:
    """The `TrainingState` a verified checkpoint holds."""
    tensors = [from_raw(t) for t in checkpoint.state_tensors]
    joined = join_tensors(checkpoint.manifest.state, tensors)
    if not isinstance(joined, dict) or not isinstance(joined.get("optimizer"), dict):
        raise CheckpointInvalid(f"{checkpoint.path}: the manifest's state lacks the optimizer's")
    return TrainingState(checkpoint.epoch, [from_raw(t) for t in checkpoint.params], joined["optimizer"],
                         joined.get("scheduler"))


def load_resume_state(directory: str | Path, run_id: str, specs: Sequence[ParamSpec]) -> tuple[TrainingState, Checkpoint]:
    """The newest verified checkpoint of `run_id` in `directory`, for a cold restart.

    Raises:
        CheckpointNotFound: none there, or all damaged.
        CheckpointRefused: the newest is another run's or model's, or of a newer format.
    """
    checkpoint = CheckpointStore(directory).load_newest(run_id, specs)
    return checkpoint_to_state(checkpoint), checkpoint


def resume_state(directory: str | Path, run_id: str, params: Sequence[torch.Tensor],
                 checkpointer: Checkpointer | None, at_least: int) -> TrainingState | None:
    """The state of a cold restart: the newest verified checkpoint in `directory`, if its epoch is at
    least `at_least` (an older one is no better than what live peers hold); None (logged) if there is
    none. The parameters must carry the names `checkpointer` gives them; without names any match.

    Raises:
        CheckpointRefused: the newest well-formed checkpoint is another run's or model's, or of a
            newer format.
    """
    names = checkpointer.config.param_names if checkpointer is not None else None
    specs = param_specs(params, names)
    if names is None:  # names unknown here: any names match, dtypes and shapes must
        specs = [ParamSpec("", s.dtype, s.shape) for s in specs]
    try:
        state, checkpoint = load_resume_state(directory, run_id, specs)
    except CheckpointNotFound as e:
        logger.warning("[%s] nothing to resume from: %s", run_id, e)
        return None
    if checkpoint.epoch < at_least:
        logger.info("[%s] not resuming from %s: live peers hold epoch %d or later", run_id, checkpoint.path,
                    at_least - 1)
        return None
    logger.info("[%s] resuming from %s (epoch %d, saved by swarm %s)", run_id, checkpoint.path, checkpoint.epoch,
                checkpoint.manifest.swarm_version)
    if checkpointer is not None:
        checkpointer.resumed_at(checkpoint.epoch)
    return state


class Checkpointer:
    """Saves a trainer's state on a schedule, writing in a thread of its own (see the module doc).

    Args:
        config: where and how often.
        run_id: the run.
        params: the parameters it saves (named by `config.param_names`).

    Raises:
        ConfigError: the names do not fit the parameters, or a dtype cannot be saved.
    """

    def __init__(self, config: CheckpointConfig, run_id: str, params: Sequence[torch.Tensor]) -> None:
        self.config = config
        self.run_id = run_id
        self.specs = param_specs(params, config.param_names)
        self.store = CheckpointStore(config.directory, keep=config.keep)
        self.last_error: OSError | None = None
        self.last_saved: Path | None = None
        self.writer_cpu_seconds: list[float] = []  # CPU time of each save's writer thread
        self.saves = 0
        self.failures = 0
        self._saved_epoch = -1
        self._saved_at = time.monotonic()
        self._writer: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()

    def resumed_at(self, epoch: int) -> None:
        """This trainer loaded the checkpoint of `epoch`: the schedule counts from there."""
        self._saved_epoch = epoch
        self._saved_at = time.monotonic()

    def due(self, epoch: int) -> bool:
        """Whether a save is due at `epoch` (and the last one finished writing)."""
        if epoch <= self._saved_epoch or not self._idle.is_set():
            return False
        cfg = self.config
        by_epochs = cfg.every_epochs is not None and epoch - max(self._saved_epoch, 0) >= cfg.every_epochs
        by_time = cfg.every_seconds is not None and time.monotonic() - self._saved_at >= cfg.every_seconds
        return by_epochs or by_time

    def save(self, state: TrainingState, samples: int, wait: bool = False) -> None:
        """Writes `state` (a snapshot no step changes: the caller cloned it) in the writer thread.

        Args:
            state: what to save.
            samples: samples this trainer has trained on.
            wait: block until it is written (at shutdown, or a user's explicit save).
        """
        if not self._idle.wait(timeout=None if wait else 0):
            return
        extra = dict(self.config.extra()) if self.config.extra is not None else {}
        self._idle.clear()
        self._saved_epoch = state.epoch
        self._saved_at = time.monotonic()
        writer = threading.Thread(target=self._write, args=(state, samples, extra), daemon=True,
                                  name=f"checkpoint-{self.run_id}-{state.epoch}")
        self._writer = writer
        writer.start()
        if wait:
            self.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the save being written, if any; False on timeout."""
        return self._idle.wait(timeout)

    def _write(self, state: TrainingState, samples: int, extra: Mapping[str, object]) -> None:
        from swarm.metrics import REGISTRY

        saves = REGISTRY.counter("swarm_checkpoint_saves_total", "Checkpoint saves of a run's state", ("outcome",))
        started, cpu_started = time.monotonic(), time.thread_time()
        try:
            params, tree, tensors = state_to_checkpoint(state, self.specs)
            self.last_saved = self.store.save(self.run_id, state.epoch, samples, params, tree, tensors, extra)
            self.last_error = None
            self.saves += 1
            self.writer_cpu_seconds.append(time.thread_time() - cpu_started)
            saves.labels(outcome="succeeded").inc()
            logger.info("[%s] saved the checkpoint of epoch %d in %.2f s (%s)", self.run_id, state.epoch,
                        time.monotonic() - started, self.last_saved)
        except OSError as e:
            self.last_error = e
            self.failures += 1
            saves.labels(outcome="failed").inc()
            logger.error("[%s] could not save the checkpoint of epoch %d in %s: %s; training goes on, the "
                         "earlier checkpoints are kept", self.run_id, state.epoch, self.config.directory, e)
        except Exception:
            self.failures += 1
            saves.labels(outcome="failed").inc()
            logger.exception("[%s] the checkpoint of epoch %d failed", self.run_id, state.epoch)
        finally:
            self._idle.set()


__all__ = ["CheckpointConfig", "Checkpointer", "checkpoint_to_state", "from_raw",
           "load_resume_state", "param_specs", "resume_state", "state_to_checkpoint", "to_raw"]
