"""The on-disk format of a run's checkpoint: a safetensors file of tensors and a JSON manifest.

A checkpoint is one directory::

    epoch-000000000042/
        tensors.safetensors   # the parameters under their names, then the optimizer's and the
                              # scheduler's tensors under "__state__.<index>"
        manifest.json         # `Manifest`: run, epoch, samples, the parameters' names, shapes and
                              # dtypes, the optimizer and scheduler state with each tensor named by
                              # its index, the sha256 and size of each file, swarm's version

Nothing here imports torch: tensors are raw bytes with a safetensors dtype name and a shape
(`RawTensor`), so archivers, `swarm-peer export` and tools read and write checkpoints without
it. The safetensors file is written by `write_safetensors` in one pass, hashing as it writes (no
second read), with direct I/O where the filesystem allows it (``O_DIRECT``, through one 16 MiB
aligned buffer: the kernel neither copies the bytes into its page cache nor spends CPU writing
them back later, which on a small machine is most of a save's CPU; tmpfs and the like get
ordinary buffered writes), and read by `read_safetensors` as views into the file's
bytes (no copy), with the checks of the format's reference library (offsets contiguous and inside
the file, sizes matching dtypes and shapes); tests check that the library reads what is written
here and the other way round.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import struct
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swarm.checkpoint.errors import CheckpointInvalid, CheckpointRefused
from swarm.core.version import __version__

FORMAT_VERSION = 1
"""The manifest's format version; a checkpoint of a newer one is refused (its meaning is unknown)."""

TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
STATE_PREFIX = "__state__."
"""Names of the optimizer's and scheduler's tensors in the safetensors file (parameters never
start with it)."""

DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}
"""Bytes per element of each safetensors dtype this format stores."""

_CHUNK = 16 << 20  # bytes written (and hashed) per call: bounded, without copying a tensor
_DIRECT_ALIGN = 4096  # direct I/O writes whole blocks from an aligned buffer
DIRECT_IO = True
"""Whether `write_safetensors` tries direct I/O (False: always the page cache; benchmarks compare)."""


@dataclass(frozen=True)
class RawTensor:
    """A tensor as bytes: a safetensors dtype name, a shape and its contiguous little-endian data."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown tensor dtype {self.dtype!r}")
        if any(not isinstance(n, int) or n < 0 for n in self.shape):
            raise ValueError(f"invalid shape {self.shape!r}")
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if memoryview(self.data).nbytes != expected:
            raise ValueError(f"{self.dtype}{list(self.shape)} needs {expected} bytes, got {memoryview(self.data).nbytes}")


@dataclass(frozen=True)
class ParamSpec:
    """A parameter's name, safetensors dtype and shape: what identifies the model a checkpoint is of."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class FileDigest:
    """A file's sha256 (hex) and size in bytes."""

    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint holds (`MANIFEST_FILE`, JSON).

    Attributes:
        run_id: the run the state belongs to.
        epoch: collective steps taken when it was saved.
        samples: samples the saving peer had trained on.
        params: the parameters in the optimizer's order.
        state: the optimizer's and the scheduler's state dicts as a JSON tree in which each tensor is
            ``{"__tensor__": index}`` (its name in the file is ``STATE_PREFIX + index``), as
            `swarm.optim.training_state` splits them; ``{"optimizer": ..., "scheduler": ...}``.
        state_tensors: how many ``__state__.*`` tensors the file holds.
        files: the sha256 and size of each file beside the manifest.
        extra: the saver's own JSON (the demo keeps its loss curve here).
        created: Unix time of the save.
        swarm_version: the version of swarm that wrote it.
        format_version: `FORMAT_VERSION` of the writer.
    """

    run_id: str
    epoch: int
    samples: int
    params: tuple[ParamSpec, ...]
    state: object
    state_tensors: int
    files: Mapping[str, FileDigest]
    extra: Mapping[str, object] = field(default_factory=dict)
    created: float = 0.0
    swarm_version: str = __version__
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        doc = {
            "format_version": self.format_version, "swarm_version": self.swarm_version, "run_id": self.run_id,
            "epoch": self.epoch, "samples": self.samples, "created": self.created,
            "params": [p.to_json() for p in self.params], "state": to_json_tree(self.state),
            "state_tensors": self.state_tensors,
            "files": {name: {"sha256": d.sha256, "size": d.size} for name, d in self.files.items()},
            "extra": to_json_tree(dict(self.extra)),
        }
        return json.dumps(doc, indent=1, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parses a manifest.

        Raises:
            CheckpointRefused: a newer format version than this swarm reads.
            CheckpointInvalid: not a manifest (truncated, corrupted, fields missing or mistyped).
        """
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointInvalid(f"the manifest is not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise CheckpointInvalid("the manifest is not a JSON object")
        version = doc.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise CheckpointInvalid("the manifest has no format version")
        if version > FORMAT_VERSION:
            raise CheckpointRefused(f"format version {version} is newer than this swarm reads ({FORMAT_VERSION}): "
                                    f"written by swarm {doc.get('swarm_version')!r}, upgrade to read it")
        try:
            params = tuple(ParamSpec(_str(p["name"]), _str(p["dtype"]), _shape(p["shape"])) for p in doc["params"])
            files = {_str(name): FileDigest(_str(d["sha256"]), _int(d["size"])) for name, d in doc["files"].items()}
            extra = from_json_tree(doc.get("extra", {}))
            manifest = cls(
                run_id=_str(doc["run_id"]), epoch=_int(doc["epoch"]), samples=_int(doc["samples"]), params=params,
                state=from_json_tree(doc["state"]), state_tensors=_int(doc["state_tensors"]), files=files,
                extra=extra if isinstance(extra, dict) else {}, created=float(doc.get("created", 0.0)),
                swarm_version=str(doc.get("swarm_version", "")), format_version=version)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointInvalid(f"the manifest lacks or mistypes a field ({type(e).__name__}: {e})") from None
        if TENSORS_FILE not in manifest.files:
            raise CheckpointInvalid(f"the manifest names no {TENSORS_FILE}")
        return manifest


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"expected a non-negative integer, got {value!r}")
    return value


def _shape(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TypeError("a shape is a list")
    return tuple(_int(n) for n in value)


# -- JSON trees: a state dict's skeleton without loss (integer keys, tuples, bytes, NaN) ----------

_ITEMS, _BYTES, _FLOAT = "__items__", "__bytes__", "__float__"


def to_json_tree(obj: object) -> object:
    """`obj` (dicts, lists, tuples, str, int, float, bool, None, bytes) as plain JSON, reversibly:
    a dict with a key that is not a string becomes ``{"__items__": [[key, value], ...]}``, bytes
    ``{"__bytes__": hex}``, a NaN or infinite float ``{"__float__": "nan"}``."""
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not {_ITEMS, _BYTES, _FLOAT} & set(obj):
            return {k: to_json_tree(v) for k, v in obj.items()}
        return {_ITEMS: [[to_json_tree(k), to_json_tree(v)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [to_json_tree(v) for v in obj]  # a tuple is marked by the skeleton itself (``__tuple__``)
    if isinstance(obj, (bytes, bytearray)):
        return {_BYTES: bytes(obj).hex()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {_FLOAT: repr(obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint's manifest")


def from_json_tree(obj: object) -> object:
    """Inverse of `to_json_tree`."""
    if isinstance(obj, dict):
        if set(obj) == {_ITEMS}:
            return {_hashable(from_json_tree(k)): from_json_tree(v) for k, v in obj[_ITEMS]}
        if set(obj) == {_BYTES}:
            return bytes.fromhex(obj[_BYTES])
        if set(obj) == {_FLOAT}:
            return float(obj[_FLOAT])
        return {k: from_json_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json_tree(v) for v in obj]
    return obj


def _hashable(key: object) -> Hashable:
    if isinstance(key, (dict, list)):
        raise TypeError("a dictionary key in the manifest is not a scalar")
    return key


# -- safetensors ---------------------------------------------------------------------------------


def safetensors_header(tensors: Sequence[tuple[str, RawTensor]], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file holding `tensors` in this order,
    padded with spaces to a multiple of 8 bytes (the data that follows stays aligned)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, tensor in tensors:
        if name in header or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} occurs twice")
        size = memoryview(tensor.data).nbytes
        header[name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def write_safetensors(path: Path, tensors: Sequence[tuple[str, RawTensor]],
                      metadata: Mapping[str, str] | None = None) -> FileDigest:
    """Writes a safetensors file, hashing as it writes, and fsyncs it; returns its digest.

    Raises:
        OSError: the write failed (disk full, permission denied); the partial file is left for the
            caller to remove.
    """
    header = safetensors_header(tensors, metadata)
    if DIRECT_IO and hasattr(os, "O_DIRECT"):
        try:
            return _write_direct(path, header, [t.data for _, t in tensors])
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # this filesystem takes no direct I/O (tmpfs): the page cache then
    return _write_buffered(path, header, [t.data for _, t in tensors])


def _write_buffered(path: Path, header: bytes, datas: Sequence[bytes | bytearray | memoryview]) -> FileDigest:
    """`write_safetensors` through the page cache."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        for piece in _pieces(header, datas):
            f.write(piece)
            digest.update(piece)
            size += piece.nbytes
        f.flush()
        os.fsync(f.fileno())
    return FileDigest(digest.hexdigest(), size)


def _write_direct(path: Path, header: bytes, datas: Sequence[bytes | bytearray | memoryview]) -> FileDigest:
    """`write_safetensors` with ``O_DIRECT``: the bytes go through one aligned buffer of `_CHUNK`
    bytes; the last block is padded and the file cut back to its size.

    Raises:
        OSError: EINVAL when the filesystem refuses direct I/O (nothing useful written), or the
            write failed.
    """
    digest = hashlib.sha256()
    size = 0
    staging = mmap.mmap(-1, _CHUNK)  # page-aligned, as direct I/O needs
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        staging.close()
        raise
    try:
        with memoryview(staging) as buffer:
            filled = 0
            for piece in _pieces(header, datas):
                digest.update(piece)
                size += piece.nbytes
                offset = 0
                while offset < piece.nbytes:
                    n = min(_CHUNK - filled, piece.nbytes - offset)
                    buffer[filled:filled + n] = piece[offset:offset + n]
                    filled += n
                    offset += n
                    if filled == _CHUNK:
                        _write_all(fd, buffer)
                        filled = 0
            if filled:
                padded = -(-filled // _DIRECT_ALIGN) * _DIRECT_ALIGN
                buffer[filled:padded] = bytes(padded - filled)
                _write_all(fd, buffer[:padded])
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
        try:
            staging.close()
        except BufferError:  # a failed write's traceback still holds a view of it: freed with that
            pass
    return FileDigest(digest.hexdigest(), size)


def _write_all(fd: int, data: memoryview) -> None:
    written = 0
    while written < data.nbytes:
        n = os.write(fd, data[written:])
        if n <= 0:
            raise OSError(errno.EIO, "a write made no progress")
        written += n


def _pieces(header: bytes, datas: Iterable[bytes | bytearray | memoryview]) -> Iterable[memoryview]:
    yield memoryview(header)
    for data in datas:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, _CHUNK):
            yield view[start:start + _CHUNK]


MAX_HEADER = 100 << 20
"""The largest safetensors header read (the reference library's limit too)."""


def read_safetensors(data: bytearray | bytes | memoryview) -> dict[str, RawTensor]:
    """The tensors of a safetensors file's bytes, by name, as views into `data` (no copy).

    Checks what the reference library checks: the header's length and JSON, each tensor's dtype,
    shape and offsets, the data's size matching them, and the tensors filling the data
    contiguously, without gap or overlap.

    Raises:
        CheckpointInvalid: not a well-formed safetensors file (truncated, header corrupted).
    """
    view = memoryview(data).cast("B")

    def bad(why: str) -> CheckpointInvalid:
        return CheckpointInvalid(f"{TENSORS_FILE} is not a valid safetensors file ({why})")

    if view.nbytes < 8:
        raise bad("shorter than its header's length")
    (length,) = struct.unpack("<Q", view[:8])
    if length > min(MAX_HEADER, view.nbytes - 8):
        raise bad(f"a header of {length} bytes in a file of {view.nbytes}")
    try:
        header = json.loads(bytes(view[8:8 + length]))
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    header.pop("__metadata__", None)
    body = view[8 + length:]
    spans: list[tuple[int, int, str]] = []
    out: dict[str, RawTensor] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if not all(isinstance(n, int) and n >= 0 for n in (begin, end, *shape)) or not begin <= end <= body.nbytes:
                raise ValueError(f"offsets [{begin}, {end}] outside {body.nbytes} bytes of data")
            out[name] = RawTensor(dtype, shape, body[begin:end])
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"tensor {name!r}: {e}") from None
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise bad(f"tensor {name!r} starts at {begin}, not at {position}: a gap or an overlap")
        position = end
    if position != body.nbytes:
        raise bad(f"the tensors fill {position} of {body.nbytes} bytes of data")
    return out
