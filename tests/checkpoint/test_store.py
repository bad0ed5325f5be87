"""The checkpoint format and store, without torch and without sockets: atomic saves, the last K
kept, damage detected on load with the next older checkpoint used, refusals with their reason,
and a save into a full filesystem that keeps training's earlier checkpoints intact."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from tmpfs import small_tmpfs

from swarm.checkpoint import (
    FORMAT_VERSION,
    CheckpointInvalid,
    CheckpointNotFound,
    CheckpointRefused,
    CheckpointStore,
    Manifest,
    ParamSpec,
    RawTensor,
)
from swarm.checkpoint.format import (
    MANIFEST_FILE,
    TENSORS_FILE,
    from_json_tree,
    read_safetensors,
    to_json_tree,
)

RUN = "run-a"


def raw(values: np.ndarray) -> RawTensor:
    dtype = {np.float32: "F32", np.int64: "I64", np.float16: "F16"}[values.dtype.type]
    return RawTensor(dtype, values.shape, np.ascontiguousarray(values).tobytes())


def params_of(epoch: int) -> list[tuple[str, RawTensor]]:
    rng = np.random.default_rng(epoch)
    return [("encoder.weight", raw(rng.standard_normal((4, 3)).astype(np.float32))),
            ("encoder.bias", raw(rng.standard_normal(3).astype(np.float32))),
            ("steps", raw(np.array([epoch], dtype=np.int64)))]


MODEL = [ParamSpec("encoder.weight", "F32", (4, 3)), ParamSpec("encoder.bias", "F32", (3,)),
         ParamSpec("steps", "I64", (1,))]
STATE = {"optimizer": {"state": {0: {"step": {"__tensor__": 0}}},
                       "param_groups": [{"lr": 1e-3, "betas": {"__tuple__": [0.9, 0.98]}, "params": [0, 1, 2]}]},
         "scheduler": None}


def save(store: CheckpointStore, epoch: int, run_id: str = RUN) -> Path:
    return store.save(run_id, epoch, samples=epoch * 100, params=params_of(epoch), state=STATE,
                      state_tensors=[raw(np.array(float(epoch), dtype=np.float32))], extra={"curve": [[0.5, 2.0]]})


def test_a_saved_checkpoint_loads_back_bit_for_bit_and_is_a_valid_safetensors_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = save(store, 7)
    loaded = store.load(7, RUN, MODEL)
    assert loaded.epoch == 7 and loaded.manifest.samples == 700 and loaded.manifest.run_id == RUN
    assert [bytes(t.data) for t in loaded.params] == [bytes(t.data) for _, t in params_of(7)]
    assert loaded.manifest.state == STATE  # integer keys and tuples survive the JSON manifest
    assert loaded.manifest.extra == {"curve": [[0.5, 2.0]]}
    assert bytes(loaded.state_tensors[0].data) == np.array(7.0, dtype=np.float32).tobytes()
    # the reference library reads the file as it is
    tensors = safetensors.numpy.load_file(str(path / TENSORS_FILE))
    np.testing.assert_array_equal(tensors["encoder.weight"], np.frombuffer(params_of(7)[0][1].data, np.float32)
                                  .reshape(4, 3))
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["format_version"] == FORMAT_VERSION and manifest["params"][0]["name"] == "encoder.weight"
    assert len(manifest["files"][TENSORS_FILE]["sha256"]) == 64


def test_files_the_reference_library_writes_are_read_as_they_are(tmp_path: Path) -> None:
    arrays = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.array([1, -2], dtype=np.int64),
              "empty": np.zeros((0, 4), dtype=np.float16)}
    safetensors.numpy.save_file(arrays, str(tmp_path / "x.safetensors"), metadata={"k": "v"})
    read = read_safetensors(bytearray((tmp_path / "x.safetensors").read_bytes()))
    assert {n: (t.dtype, t.shape) for n, t in read.items()} == {"a": ("I64", (2,)), "b": ("F32", (2, 3)),
                                                               "empty": ("F16", (0, 4))}
    np.testing.assert_array_equal(np.frombuffer(read["b"].data, np.float32).reshape(2, 3), arrays["b"])


@pytest.mark.parametrize(("offsets", "why"), [([[0, 8], [4, 12]], "a gap or an overlap"),
                                              ([[0, 8], [12, 20]], "a gap or an overlap"),
                                              ([[0, 8], [8, 16]], "fill 16 of 20 bytes"),
                                              ([[0, 8], [8, 24]], "outside 20 bytes")])
def test_malformed_safetensors_offsets_are_refused(offsets: list[list[int]], why: str) -> None:
    header = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": offsets[0]},
                         "y": {"dtype": "F32", "shape": [(offsets[1][1] - offsets[1][0]) // 4],
                               "data_offsets": offsets[1]}}).encode()
    data = struct.pack("<Q", len(header)) + header + bytes(20)
    with pytest.raises(CheckpointInvalid, match=why):
        read_safetensors(data)
    with pytest.raises(CheckpointInvalid, match="header of"):
        read_safetensors(struct.pack("<Q", 1 << 40) + b"{}")


def test_the_store_keeps_the_last_k_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for epoch in (1, 2, 3, 4):
        save(store, epoch)
    assert store.epochs() == [4, 3]
    assert sorted(os.listdir(tmp_path)) == ["epoch-000000000003", "epoch-000000000004"]


def test_saving_an_epoch_already_present_keeps_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    first = save(store, 3)
    before = (first / MANIFEST_FILE).read_bytes()
    assert save(store, 3) == first and (first / MANIFEST_FILE).read_bytes() == before


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "no-manifest"])
def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_is_used(tmp_path: Path, damage: str) -> None:
    store = CheckpointStore(tmp_path)
    save(store, 1)
    newest = save(store, 2)
    tensors = newest / TENSORS_FILE
    if damage == "truncate":
        os.truncate(tensors, tensors.stat().st_size // 2)
    elif damage == "flip":
        data = bytearray(tensors.read_bytes())
        data[-1] ^= 0xFF
        tensors.write_bytes(bytes(data))
    elif damage == "manifest":
        (newest / MANIFEST_FILE).write_bytes((newest / MANIFEST_FILE).read_bytes()[:40])
    else:
        (newest / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointInvalid) as error:
        store.load(2, RUN, MODEL)
    expected = {"truncate": "truncated", "flip": "sha256", "manifest": "JSON", "no-manifest": "no manifest"}[damage]
    assert expected in str(error.value)
    assert store.load_newest(RUN, MODEL).epoch == 1


def test_a_consistent_but_malformed_tensors_file_is_refused_by_the_safetensors_reader(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = save(store, 1)
    garbage = b"\xff" * 64
    (path / TENSORS_FILE).write_bytes(garbage)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][TENSORS_FILE] = {"sha256": __import__("hashlib").sha256(garbage).hexdigest(), "size": 64}
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointInvalid, match="not a valid safetensors file"):
        store.load(1)


def test_every_checkpoint_damaged_is_not_found_with_each_reason(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for epoch in (1, 2):
        os.truncate(save(store, epoch) / TENSORS_FILE, 10)
    with pytest.raises(CheckpointNotFound, match="epoch-000000000002: .*truncated.*epoch-000000000001: .*truncated"):
        store.load_newest(RUN)
    with pytest.raises(CheckpointNotFound, match="no checkpoint"):
        CheckpointStore(tmp_path / "empty").load_newest(RUN)


def test_another_run_another_model_or_a_newer_format_is_refused_with_the_reason(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = save(store, 1)
    with pytest.raises(CheckpointRefused, match="run 'run-a', not of run 'run-b'"):
        store.load_newest("run-b")
    other = [MODEL[0], ParamSpec("encoder.bias", "F32", (5,)), MODEL[2]]
    with pytest.raises(CheckpointRefused, match=r"another model: parameter 1 is 'encoder.bias' F32\[3\] there"):
        store.load_newest(RUN, other)
    with pytest.raises(CheckpointRefused, match="another model: 3 parameters, this model has 2"):
        store.load_newest(RUN, MODEL[:2])
    renamed = [ParamSpec("decoder.weight", "F32", (4, 3)), *MODEL[1:]]
    with pytest.raises(CheckpointRefused, match="parameter 0 is 'encoder.weight' F32\\[4, 3\\] there, 'decoder.weight'"):
        store.load_newest(RUN, renamed)
    unnamed = [ParamSpec("", s.dtype, s.shape) for s in MODEL]  # a loader that knows no names: shapes decide
    assert store.load_newest(RUN, unnamed).epoch == 1
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointRefused, match=f"format version {FORMAT_VERSION + 1} is newer"):
        store.load_newest(RUN)


def test_a_save_into_an_unwritable_directory_raises_and_leaves_the_others(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory (the full filesystem test covers a failed save)")
    store = CheckpointStore(tmp_path)
    save(store, 1)
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(PermissionError):
            save(store, 2)
    finally:
        tmp_path.chmod(0o700)
    assert store.epochs() == [1] and store.load_newest(RUN).epoch == 1


def test_json_trees_keep_integer_keys_bytes_and_non_finite_floats() -> None:
    tree = {0: {"a": (1, 2)}, "b": b"\x00\x01", "c": [float("inf"), 1.5], "__items__": 3}
    back = from_json_tree(json.loads(json.dumps(to_json_tree(tree), allow_nan=False)))
    assert back == {0: {"a": [1, 2]}, "b": b"\x00\x01", "c": [float("inf"), 1.5], "__items__": 3}
    with pytest.raises(TypeError, match="object"):
        to_json_tree({"x": object()})


def test_a_manifest_missing_a_field_is_invalid() -> None:
    with pytest.raises(CheckpointInvalid, match="lacks or mistypes a field"):
        Manifest.from_json(json.dumps({"format_version": 1, "run_id": "r"}).encode())
    with pytest.raises(CheckpointInvalid, match="no format version"):
        Manifest.from_json(b"{}")


def test_raw_tensors_check_their_size() -> None:
    with pytest.raises(ValueError, match="needs 12 bytes"):
        RawTensor("F32", (3,), b"\x00" * 8)
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        RawTensor("F33", (1,), b"\x00" * 4)


@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "full") as where:
        yield where


def test_a_save_into_a_full_filesystem_raises_and_keeps_the_earlier_checkpoints(full_fs: Path) -> None:
    store = CheckpointStore(full_fs, keep=5)
    save(store, 1)
    big = [("w", RawTensor("U8", (2 << 20,), bytes(2 << 20)))]  # twice the filesystem
    with pytest.raises(OSError) as error:
        store.save(RUN, 2, 0, big, STATE, [])
    assert error.value.errno == 28  # ENOSPC
    assert os.listdir(full_fs) == ["epoch-000000000001"]  # the partial one removed, the old one kept
    assert store.load_newest(RUN, MODEL).epoch == 1


def direct_io_works(directory: Path) -> bool:
    try:
        fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    (directory / "probe").unlink()
    return True


@pytest.mark.parametrize("size", [0, 1, 4095, 4097, (16 << 20) - 16, (16 << 20) + 3])
def test_direct_io_writes_the_same_bytes_and_digest_as_the_page_cache(tmp_path: Path, size: int) -> None:
    from swarm.checkpoint.format import _write_buffered, _write_direct, safetensors_header

    if not direct_io_works(tmp_path):
        pytest.skip("this filesystem takes no O_DIRECT (write_safetensors falls back to buffered writes)")
    data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    tensors = [("a", RawTensor("U8", (size,), data.tobytes())), ("b", RawTensor("F32", (2,), b"\x00" * 8))]
    header = safetensors_header(tensors)
    direct = _write_direct(tmp_path / "direct", header, [t.data for _, t in tensors])
    buffered = _write_buffered(tmp_path / "buffered", header, [t.data for _, t in tensors])
    written = (tmp_path / "direct").read_bytes()
    assert written == (tmp_path / "buffered").read_bytes()  # not padded: cut back to its size
    assert direct == buffered and direct.size == len(written)
    assert direct.sha256 == hashlib.sha256(written).hexdigest()
    assert read_safetensors(written)["a"].data == data.tobytes()
