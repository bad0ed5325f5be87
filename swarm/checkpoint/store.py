"""A directory of a run's checkpoints: saved atomically, the last K kept, the newest usable one loaded.

A save writes the checkpoint's files into a temporary directory beside the others (``.tmp-*``),
fsyncs them and the directory, renames it to ``epoch-<12 digits>`` and fsyncs the parent, so a
crash at any moment leaves either the whole new checkpoint or none; only then are checkpoints
beyond the last `keep` removed. A save that fails (disk full, permission denied) removes its
temporary directory and raises `OSError`; earlier checkpoints are never touched before the new
one is complete.

A load checks everything it reads: the manifest parses, the file sizes and sha256 digests match
it, the safetensors header is well formed and its tensors are the ones the manifest names. A
checkpoint that fails any of these is `CheckpointInvalid` and `load_newest` moves on to the next
older one; one of another run, another model or a newer format is `CheckpointRefused`, which it
raises at once: that needs the user's decision, not a silent fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from swarm.checkpoint.errors import CheckpointInvalid, CheckpointNotFound, CheckpointRefused
from swarm.checkpoint.format import (
    MANIFEST_FILE,
    STATE_PREFIX,
    TENSORS_FILE,
    Manifest,
    ParamSpec,
    RawTensor,
    read_safetensors,
    write_safetensors,
)

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^epoch-(\d{12})$")
_TMP = ".tmp-"
_READ_CHUNK = 16 << 20
STALE_TMP_SECONDS = 3600.0
"""A temporary directory older than this is a crashed save's, removed when a store opens."""


def checkpoint_name(epoch: int) -> str:
    return f"epoch-{epoch:012d}"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded, verified checkpoint: its manifest, the parameters in its order, the state's tensors."""

    path: Path
    manifest: Manifest
    params: list[RawTensor]
    state_tensors: list[RawTensor]

    @property
    def epoch(self) -> int:
        return self.manifest.epoch


class CheckpointStore:
    """The checkpoints of one directory (created if missing).

    Args:
        root: the directory.
        keep: how many of the newest checkpoints a save leaves (at least 1).
    """

    def __init__(self, root: str | os.PathLike[str], keep: int = 3) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        self.root = Path(root)
        self.keep = keep

    def epochs(self) -> list[int]:
        """The epochs of the checkpoints present, newest first (nothing checked yet)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted((int(m.group(1)) for n in names if (m := _NAME.match(n))), reverse=True)

    def path_of(self, epoch: int) -> Path:
        return self.root / checkpoint_name(epoch)

    # -- saving ---------------------------------------------------------------------------------

    def save(self, run_id: str, epoch: int, samples: int, params: Sequence[tuple[str, RawTensor]], state: object,
             state_tensors: Sequence[RawTensor], extra: Mapping[str, object] | None = None) -> Path:
        """Writes a checkpoint of `epoch` atomically and removes those beyond the newest `keep`.

        A checkpoint of this epoch already present (another peer sharing the directory saved it,
        or this peer resumed from it) is kept as it is.

        Args:
            run_id: the run.
            epoch: collective steps taken.
            samples: samples the saving peer trained on.
            params: the parameters by name, in the optimizer's order.
            state: the optimizer's and scheduler's state as a tree whose tensors are
                ``{"__tensor__": index}`` into `state_tensors`.
            state_tensors: those tensors.
            extra: the saver's own JSON-able data, kept in the manifest.

        Raises:
            OSError: the directory or a file could not be written (disk full, permission denied);
                nothing was changed but the temporary directory, which is removed.
            ValueError: a parameter name is reserved or repeated.
        """
        final = self.path_of(epoch)
        if final.exists():
            return final
        for name, _ in params:
            if not name or name.startswith(STATE_PREFIX):
                raise ValueError(f"parameter name {name!r} is empty or reserved")
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_tmp()
        tmp = self.root / f"{_TMP}{checkpoint_name(epoch)}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            named = list(params) + [(f"{STATE_PREFIX}{i}", t) for i, t in enumerate(state_tensors)]
            digest = write_safetensors(tmp / TENSORS_FILE, named, {"format": "pt", "run_id": run_id,
                                                                   "epoch": str(epoch)})
            manifest = Manifest(
                run_id=run_id, epoch=epoch, samples=samples,
                params=tuple(ParamSpec(name, t.dtype, t.shape) for name, t in params), state=state,
                state_tensors=len(state_tensors), files={TENSORS_FILE: digest}, extra=dict(extra or {}),
                created=time.time())
            _write_synced(tmp / MANIFEST_FILE, manifest.to_json())
            _fsync_dir(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if final.exists():  # another saver sharing the directory got there first
                    shutil.rmtree(tmp, ignore_errors=True)
                    return final
                raise
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune()
        return final

    def prune(self) -> None:
        """Removes the checkpoints beyond the newest `keep` (renamed away first, so a removal cut
        short never leaves something that looks like a checkpoint)."""
        for epoch in self.epochs()[self.keep:]:
            doomed = self.root / f"{_TMP}removed-{checkpoint_name(epoch)}-{secrets.token_hex(4)}"
            try:
                os.rename(self.path_of(epoch), doomed)
            except FileNotFoundError:
                continue  # another saver sharing the directory removed it
            except OSError as e:
                logger.warning("could not remove the old checkpoint %s: %s", self.path_of(epoch), e)
                continue
            shutil.rmtree(doomed, ignore_errors=True)

    def _remove_stale_tmp(self) -> None:
        now = time.time()
        for entry in os.scandir(self.root):
            if entry.name.startswith(_TMP):
                try:
                    if now - entry.stat().st_mtime > STALE_TMP_SECONDS:
                        shutil.rmtree(entry.path, ignore_errors=True)
                except OSError:
                    pass

    # -- loading --------------------------------------------------------------------------------

    def load(self, epoch: int, run_id: str | None = None, model: Sequence[ParamSpec] | None = None) -> Checkpoint:
        """Loads and verifies the checkpoint of `epoch`.

        Args:
            epoch: which one.
            run_id: refuse a checkpoint of another run (None: any run).
            model: refuse a checkpoint whose parameters differ in count, name, dtype or shape.

        Raises:
            CheckpointInvalid: truncated or corrupted.
            CheckpointRefused: another run, another model, or a newer format.
        """
        return load_checkpoint(self.path_of(epoch), run_id, model)

    def load_newest(self, run_id: str | None = None, model: Sequence[ParamSpec] | None = None) -> Checkpoint:
        """The newest checkpoint that verifies; a damaged one is logged and the next older one tried.

        Raises:
            CheckpointRefused: the newest well-formed checkpoint is another run's or model's, or of
                a newer format (never skipped silently).
            CheckpointNotFound: none present, or every one is damaged (the message says why each).
        """
        reasons = []
        for epoch in self.epochs():
            try:
                return self.load(epoch, run_id, model)
            except CheckpointInvalid as e:
                logger.error("checkpoint %s is damaged, trying the one before: %s", self.path_of(epoch), e)
                reasons.append(f"{checkpoint_name(epoch)}: {e}")
        if not reasons:
            raise CheckpointNotFound(f"no checkpoint in {self.root}")
        raise CheckpointNotFound(f"no usable checkpoint in {self.root}: {'; '.join(reasons)}")


def load_checkpoint(path: Path, run_id: str | None = None, model: Sequence[ParamSpec] | None = None) -> Checkpoint:
    """Loads and verifies the checkpoint in directory `path` (see `CheckpointStore.load`)."""
    try:
        raw_manifest = (path / MANIFEST_FILE).read_bytes()
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path} has no {MANIFEST_FILE}") from None
    except OSError as e:
        raise CheckpointInvalid(f"cannot read {path / MANIFEST_FILE}: {e}") from None
    manifest = Manifest.from_json(raw_manifest)
    if run_id is not None and manifest.run_id != run_id:
        raise CheckpointRefused(f"{path} is a checkpoint of run {manifest.run_id!r}, not of run {run_id!r}")
    if model is not None:
        check_model(manifest.params, model, path)
    name_match = _NAME.match(path.name)
    if name_match is not None and int(name_match.group(1)) != manifest.epoch:
        raise CheckpointInvalid(f"{path.name} holds a manifest of epoch {manifest.epoch}")
    expected = manifest.files[TENSORS_FILE]
    try:
        size = (path / TENSORS_FILE).stat().st_size
        if size != expected.size:
            raise CheckpointInvalid(f"{path / TENSORS_FILE} is truncated or padded: {size} bytes, "
                                    f"the manifest says {expected.size}")
        data, sha256 = read_hashed(path / TENSORS_FILE, size)
    except OSError as e:
        raise CheckpointInvalid(f"cannot read {path / TENSORS_FILE}: {e}") from None
    if len(data) != expected.size or sha256 != expected.sha256:
        raise CheckpointInvalid(f"{path / TENSORS_FILE} is corrupted: its sha256 differs from the manifest's")
    tensors = read_safetensors(data)  # views into `data`: the tensors keep it alive
    params = []
    for spec in manifest.params:
        tensor = tensors.get(spec.name)
        if tensor is None or tensor.dtype != spec.dtype or tensor.shape != spec.shape:
            raise CheckpointInvalid(f"{TENSORS_FILE} lacks parameter {spec.name!r} as the manifest describes it")
        params.append(tensor)
    state_tensors = []
    for i in range(manifest.state_tensors):
        tensor = tensors.get(f"{STATE_PREFIX}{i}")
        if tensor is None:
            raise CheckpointInvalid(f"{TENSORS_FILE} lacks state tensor {i}")
        state_tensors.append(tensor)
    return Checkpoint(path, manifest, params, state_tensors)


def check_model(saved: Sequence[ParamSpec], model: Sequence[ParamSpec], where: Path | str) -> None:
    """Raises `CheckpointRefused` unless `saved` and `model` hold the same parameters alike: same
    count, dtypes and shapes, and the same names where `model` names them (an empty name matches
    any: a loader that does not know its parameters' names)."""
    if len(saved) != len(model):
        raise CheckpointRefused(f"{where} is a checkpoint of another model: {len(saved)} parameters, "
                                f"this model has {len(model)}")
    for i, (theirs, mine) in enumerate(zip(saved, model)):
        if (theirs.dtype, theirs.shape) != (mine.dtype, mine.shape) or (mine.name and theirs.name != mine.name):
            raise CheckpointRefused(f"{where} is a checkpoint of another model: parameter {i} is "
                                    f"{theirs.name!r} {theirs.dtype}{list(theirs.shape)} there, "
                                    f"{mine.name!r} {mine.dtype}{list(mine.shape)} here")


def read_hashed(path: Path, size: int) -> tuple[bytearray, str]:
    """Reads `path` (of `size` bytes) into one buffer and its sha256, hashing each chunk in a
    thread while the next one is read (the two take about as long). A file that shrank meanwhile
    comes back shorter."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    digest = hashlib.sha256()
    position = 0
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") as pool:
        hashing: Future[None] | None = None
        while position < size:
            count = f.readinto(view[position:position + _READ_CHUNK])
            if not count:
                del buffer[position:]
                break
            if hashing is not None:
                hashing.result()
            hashing = pool.submit(digest.update, view[position:position + count])
            position += count
        if hashing is not None:
            hashing.result()
    return buffer, digest.hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
