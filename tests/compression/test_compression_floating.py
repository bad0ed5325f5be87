"""NONE, FLOAT16 and SCALED_FLOAT16: round-trip error bounds and non-finite handling."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.compression import CompressionError, CompressionType, decode, encode, has_nonfinite

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _data(kind: str, n: int = 50_000, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=generator)
    if kind == "uniform":
        return torch.rand(n, generator=generator) * 8 - 3
    if kind == "constant":
        return torch.full((n,), 0.3)
    if kind == "tiny":
        return torch.randn(n, generator=generator) * 1e-30
    if kind == "large":
        return torch.randn(n, generator=generator) * 1e30
    raise ValueError(kind)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kind", ["normal", "uniform", "constant", "tiny", "large"])
def test_none_is_bit_exact(kind: str, dtype: torch.dtype) -> None:
    x = _data(kind).to(dtype)
    y = decode(encode(x, CompressionType.NONE))
    assert y.dtype == dtype
    assert torch.equal(y, x)


@pytest.mark.parametrize("kind", ["normal", "uniform", "constant"])
def test_float16_relative_error_in_range(kind: str) -> None:
    x = _data(kind) * 1000  # well inside float16's normal range for almost every element
    y = decode(encode(x, CompressionType.FLOAT16))
    assert y.dtype == torch.float32
    # Round to nearest: relative error <= 2**-11 in the normal range, absolute <= 2**-25 below it.
    assert torch.all((y - x).abs() <= 2**-11 * x.abs() + 2**-25)


def test_float16_flushes_tiny_values_without_error() -> None:
    x = _data("tiny")
    y = decode(encode(x, CompressionType.FLOAT16))
    assert torch.all((y - x).abs() <= 2**-25)


@pytest.mark.parametrize("value", [65520.0, -1e5, 1e30])
def test_float16_refuses_overflow(value: float) -> None:
    x = torch.zeros(100)
    x[17] = value
    with pytest.raises(CompressionError, match="SCALED_FLOAT16"):
        encode(x, CompressionType.FLOAT16)


def test_float16_keeps_its_largest_values() -> None:
    x = torch.tensor([65504.0, -65504.0, 65519.0, 1.0])
    y = decode(encode(x, CompressionType.FLOAT16))
    assert y.tolist() == [65504.0, -65504.0, 65504.0, 1.0]


@pytest.mark.parametrize("kind", [CompressionType.NONE, CompressionType.FLOAT16])
def test_nonfinite_values_pass_through_exact_types(kind: CompressionType) -> None:
    x = torch.tensor([1.0, math.nan, math.inf, -math.inf, -2.5])
    y = decode(encode(x, kind))
    assert torch.isnan(y[1])
    assert y[2] == math.inf and y[3] == -math.inf
    assert y[0] == 1.0 and y[4] == -2.5
    assert has_nonfinite(x) and has_nonfinite(y)


def test_float16_refuses_finite_overflow_next_to_nonfinite_values() -> None:
    with pytest.raises(CompressionError):
        encode(torch.tensor([math.nan, 1e6, 1.0]), CompressionType.FLOAT16)
    with pytest.raises(CompressionError):
        encode(torch.tensor([math.inf, -7e4]), CompressionType.FLOAT16)


def test_has_nonfinite() -> None:
    assert not has_nonfinite(torch.randn(1000))
    assert not has_nonfinite(torch.empty(0))
    assert not has_nonfinite(torch.arange(5))  # integers are always finite
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.zeros(3, 4, dtype=torch.bfloat16)
        x[2, 1] = bad
        assert has_nonfinite(x)


@pytest.mark.parametrize("kind", ["normal", "uniform", "constant", "tiny", "large"])
def test_scaled_float16_error_relative_to_largest_magnitude(kind: str) -> None:
    x = _data(kind)
    y = decode(encode(x, CompressionType.SCALED_FLOAT16))
    largest = x.abs().max()
    assert torch.all((y - x).abs() <= 2**-11 * largest)
    # Scaling is by a power of two, so elements keep float16's relative precision.
    relevant = x.abs() >= largest * 2**-28
    assert torch.all((y - x).abs()[relevant] <= 2**-11 * x.abs()[relevant])


def test_scaled_float16_handles_float64_beyond_float32() -> None:
    x = torch.randn(1000, dtype=torch.float64) * 1e300
    y = decode(encode(x, CompressionType.SCALED_FLOAT16))
    assert y.dtype == torch.float64
    assert torch.all((y - x).abs() <= 2**-11 * x.abs().max())


def test_constant_power_of_two_is_exact_in_float_types() -> None:
    x = torch.full((1000,), -0.5)
    for kind in (CompressionType.FLOAT16, CompressionType.SCALED_FLOAT16):
        assert torch.equal(decode(encode(x, kind)), x)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_scaled_float16_refuses_nonfinite(bad: float) -> None:
    x = torch.randn(100)
    x[50] = bad
    with pytest.raises(CompressionError, match="NaN or inf"):
        encode(x, CompressionType.SCALED_FLOAT16)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kind", [CompressionType.FLOAT16, CompressionType.SCALED_FLOAT16])
def test_half_types_accept_every_input_dtype(kind: CompressionType, dtype: torch.dtype) -> None:
    x = _data("normal", 1000).to(dtype)
    y = decode(encode(x, kind))
    assert y.dtype == dtype
    tolerance = 2**-8 if dtype == torch.bfloat16 else 2**-11
    assert torch.all((y.double() - x.double()).abs() <= tolerance * x.double().abs().max())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_none_views_are_the_payload_and_share_the_tensors_memory(dtype: torch.dtype) -> None:
    from swarm.compression import get_codec

    codec = get_codec(CompressionType.NONE)
    x = _data("normal", 1000).to(dtype)
    views = codec.encode_views(x[100:900])
    assert b"".join(views) == codec.encode(x[100:900])
    x[100] = 7  # a view, not a copy: it must stay unchanged until sent (the caller's promise)
    assert b"".join(views) == codec.encode(x[100:900])
    assert codec.encode_views(torch.empty(0, dtype=dtype)) == (codec.encode(torch.empty(0, dtype=dtype)),)


def test_lossy_codecs_views_are_their_encoding() -> None:
    from swarm.compression import get_codec

    x = _data("normal", 1000)
    for kind in (CompressionType.FLOAT16, CompressionType.SCALED_FLOAT16):
        codec = get_codec(kind)
        assert codec.encode_views(x) == (codec.encode(x),)
