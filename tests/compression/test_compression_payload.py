"""The payload format shared by every codec: sizes, dispatch, decode_add, malformed input."""

from __future__ import annotations

import struct
import threading

import pytest
import torch

from swarm.compression import (
    HEADER_SIZE,
    CompressionError,
    CompressionType,
    Quantile8BitQuantization,
    decode,
    decode_add,
    encode,
    get_codec,
    read_header,
)
from swarm.core.errors import SwarmError

KINDS = list(CompressionType)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
LOSSY = [CompressionType.SCALED_FLOAT16, CompressionType.UNIFORM_8BIT, CompressionType.QUANTILE_8BIT]


def _normal(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 2, 255, 256, 257, 4097, 70_001])
def test_encoded_size_is_exact(kind: CompressionType, dtype: torch.dtype, n: int) -> None:
    payload = encode(_normal(n, dtype=dtype), kind)
    assert len(payload) == get_codec(kind).encoded_size(n, dtype)
    header = read_header(payload)
    assert (header.kind, header.dtype, header.numel) == (kind, dtype, n)
    assert payload[0] == kind


def test_encoded_size_of_several_quantile_blocks() -> None:
    codec = Quantile8BitQuantization(block_numel=256)
    for n in (0, 1, 256, 257, 1000):
        assert len(codec.encode(_normal(n))) == codec.encoded_size(n) == 24 + -(-n // 256) * 1024 + n


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 65_536, 5_000, 1])
def test_chunk_numel_fills_the_chunk(kind: CompressionType, chunk_bytes: int) -> None:
    codec = get_codec(kind)
    numel = codec.chunk_numel(chunk_bytes)
    assert numel >= 1
    if codec.encoded_size(1) <= chunk_bytes:
        assert codec.encoded_size(numel) <= chunk_bytes < codec.encoded_size(numel + 1)


def test_chunk_numel_of_one_mebibyte() -> None:
    expected = {
        CompressionType.NONE: 262_140,
        CompressionType.FLOAT16: 524_280,
        CompressionType.SCALED_FLOAT16: 524_276,
        CompressionType.UNIFORM_8BIT: 1_048_544,
        CompressionType.QUANTILE_8BIT: 1_047_528,
        CompressionType.UNIFORM_4BIT: 1_973_760,
    }
    assert {kind: get_codec(kind).chunk_numel() for kind in KINDS} == expected
    assert get_codec(CompressionType.NONE).chunk_numel(dtype=torch.float16) == 524_280


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [0, 1])
def test_empty_and_single_element(kind: CompressionType, n: int) -> None:
    x = torch.full((n,), -2.5)
    assert torch.equal(decode(encode(x, kind)), x)
    out = torch.full((n,), 1.0)
    decode_add(encode(x, kind), out, 2.0)
    assert torch.equal(out, torch.full((n,), -4.0))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("weight", [1.0, 0.25, -3.0])
def test_decode_add_equals_weighted_decode_plus_out(kind: CompressionType, weight: float) -> None:
    payload = encode(_normal(20_000, seed=1), kind)
    start = _normal(20_000, seed=2)
    out = start.clone()
    decode_add(payload, out, weight)
    # Same values up to float32 rounding (a codec may fold `weight` into its scale).
    torch.testing.assert_close(out, start + weight * decode(payload), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("out_dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_decode_into_another_dtype(kind: CompressionType, out_dtype: torch.dtype) -> None:
    payload = encode(_normal(5_000, seed=3), kind)
    reference = decode(payload)
    out = torch.empty(5_000, dtype=out_dtype)
    decode(payload, out)
    torch.testing.assert_close(out, reference.to(out_dtype))
    accumulator = torch.ones(5_000, dtype=out_dtype)
    decode_add(payload, accumulator, 0.5)
    torch.testing.assert_close(accumulator, (1 + 0.5 * reference.double()).to(out_dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_any_shape_in_and_out(kind: CompressionType) -> None:
    x = _normal(60, seed=4).view(3, 4, 5).transpose(0, 2)  # non-contiguous input
    payload = encode(x, kind)
    assert payload == encode(x.contiguous(), kind)
    assert read_header(payload).numel == 60
    out = torch.zeros(60, 2)[:, 1]  # non-contiguous output
    decode(payload, out)
    torch.testing.assert_close(out, decode(payload))
    matrix = torch.zeros(6, 10)
    decode_add(payload, matrix, 2.0)
    torch.testing.assert_close(matrix.view(-1), 2 * decode(payload))


def test_tensor_requiring_grad_is_encoded() -> None:
    x = _normal(100).requires_grad_()
    assert torch.equal(decode(encode(x, CompressionType.NONE)), x.detach())


@pytest.mark.parametrize("kind", KINDS)
def test_payload_as_bytearray_or_unaligned_memoryview(kind: CompressionType) -> None:
    payload = encode(_normal(1000, seed=5), kind)
    expected = decode(payload)
    assert torch.equal(decode(bytearray(payload)), expected)
    received = bytearray(1) + payload  # as if read into a buffer at an odd offset
    assert torch.equal(decode(memoryview(received)[1:]), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_encode_into_a_caller_buffer(kind: CompressionType) -> None:
    x = _normal(3000, seed=6)
    codec = get_codec(kind)
    buffer = bytearray(codec.encoded_size(3000) + 10)
    written = codec.encode_into(x, buffer)
    assert written == codec.encoded_size(3000)
    assert bytes(buffer[:written]) == codec.encode(x)
    with pytest.raises(ValueError, match="cannot hold"):
        codec.encode_into(x, bytearray(written - 1))
    with pytest.raises(ValueError, match="writable"):
        codec.encode_into(x, bytes(written))


def test_concurrent_threads_get_their_own_scratch_buffers() -> None:
    tensors = [_normal(50_000, seed=seed) for seed in range(4)]
    expected = {(kind, i): encode(t, kind) for kind in KINDS for i, t in enumerate(tensors)}
    failures: list[str] = []

    def work(i: int) -> None:
        for _ in range(5):
            for kind in KINDS:
                payload = encode(tensors[i], kind)
                if payload != expected[kind, i]:
                    failures.append(f"{kind.name} encode in thread {i}")
                if not torch.equal(decode(payload), decode(expected[kind, i])):
                    failures.append(f"{kind.name} decode in thread {i}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures


def test_unsupported_dtypes_and_types_are_refused() -> None:
    with pytest.raises(TypeError):
        encode(torch.arange(10), CompressionType.NONE)
    with pytest.raises(TypeError):
        encode([1.0, 2.0], CompressionType.NONE)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        decode(encode(_normal(10), CompressionType.NONE), torch.zeros(10, dtype=torch.int64))
    with pytest.raises(CompressionError):
        encode(_normal(10), 17)
    with pytest.raises(CompressionError):
        get_codec(6)
    with pytest.raises(ValueError):
        decode_add(encode(_normal(10), CompressionType.NONE), torch.zeros(10), float("nan"))


# --- malformed payloads ------------------------------------------------------------------------


def _malformed(payload: bytes, **fields: int) -> bytes:
    kind, version, dtype, numel = struct.unpack_from("<BBB5xQ", payload)
    values = {"kind": kind, "version": version, "dtype": dtype, "numel": numel, **fields}
    header = struct.pack("<BBB5xQ", values["kind"], values["version"], values["dtype"], values["numel"])
    return header + payload[HEADER_SIZE:]


@pytest.mark.parametrize("kind", KINDS)
def test_malformed_payloads_raise_compression_error(kind: CompressionType) -> None:
    payload = encode(_normal(1000, seed=7), kind)
    out = torch.zeros(1000)
    bad = {
        "empty": b"",
        "shorter than a header": payload[:10],
        "truncated": payload[:-1],
        "header only": payload[:HEADER_SIZE],
        "trailing byte": payload + b"\0",
        "unknown type": _malformed(payload, kind=99),
        "unknown version": _malformed(payload, version=7),
        "unknown dtype": _malformed(payload, dtype=42),
        "numel too large": _malformed(payload, numel=1001),
        "numel huge": _malformed(payload, numel=2**63),
    }
    for name, malformed in bad.items():
        with pytest.raises(CompressionError):
            decode(malformed, out)
            pytest.fail(f"decode accepted a payload with {name}")
        with pytest.raises(CompressionError):
            decode_add(malformed, out, 1.0)
    assert torch.equal(out, torch.zeros(1000))  # nothing was written
    with pytest.raises(CompressionError):
        decode(_malformed(payload, numel=2**62))  # refused before allocating 2**62 elements


@pytest.mark.parametrize("kind", KINDS)
def test_element_count_must_match_out(kind: CompressionType) -> None:
    payload = encode(_normal(1000), kind)
    for wrong in (999, 1001, 0):
        with pytest.raises(CompressionError, match="elements"):
            decode(payload, torch.zeros(wrong))
        with pytest.raises(CompressionError, match="elements"):
            decode_add(payload, torch.zeros(wrong))


def test_codec_refuses_payload_of_another_type() -> None:
    payload = encode(_normal(100), CompressionType.NONE)
    with pytest.raises(CompressionError, match="FLOAT16 codec cannot decode a NONE payload"):
        get_codec(CompressionType.FLOAT16).decode(payload, torch.zeros(100))


def test_compression_error_is_a_swarm_value_error() -> None:
    assert issubclass(CompressionError, SwarmError)
    assert issubclass(CompressionError, ValueError)
    with pytest.raises(CompressionError):
        decode(12345)  # type: ignore[arg-type]


def _patched(payload: bytes, offset: int, data: bytes) -> bytes:
    return payload[:offset] + data + payload[offset + len(data) :]


@pytest.mark.parametrize(
    ("kind", "offset", "data"),
    [
        (CompressionType.SCALED_FLOAT16, HEADER_SIZE, struct.pack("<d", float("nan"))),
        (CompressionType.SCALED_FLOAT16, HEADER_SIZE, struct.pack("<d", -1.0)),
        (CompressionType.UNIFORM_8BIT, HEADER_SIZE, struct.pack("<d", float("inf"))),
        (CompressionType.UNIFORM_8BIT, HEADER_SIZE + 8, struct.pack("<d", -0.5)),
        (CompressionType.QUANTILE_8BIT, HEADER_SIZE, struct.pack("<I", 0)),
        (CompressionType.QUANTILE_8BIT, HEADER_SIZE, struct.pack("<I", 100)),
        (CompressionType.QUANTILE_8BIT, HEADER_SIZE + 8 + 4 * 17, struct.pack("<f", float("nan"))),
    ],
)
def test_invalid_body_fields_are_refused(kind: CompressionType, offset: int, data: bytes) -> None:
    payload = _patched(encode(_normal(1000, seed=8), kind), offset, data)
    with pytest.raises(CompressionError):
        decode(payload)


def test_quantile_block_size_changes_the_expected_length() -> None:
    payload = encode(_normal(1000, seed=9), CompressionType.QUANTILE_8BIT)
    # Claiming 256-element blocks means four codebooks: the payload is then too short.
    with pytest.raises(CompressionError, match="bytes"):
        decode(_patched(payload, HEADER_SIZE, struct.pack("<I", 256)))
