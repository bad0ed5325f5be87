"""UNIFORM_4BIT: error within half a block's step, exact constants, 4.25 bits per element, refused
non-finite input and malformed payloads."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.compression import CompressionError, CompressionType, decode, decode_add, encode, get_codec
from swarm.compression.uniform4 import BLOCK

KIND = CompressionType.UNIFORM_4BIT


def _ulp32(magnitude: float) -> float:
    return math.ldexp(1.0, math.frexp(magnitude)[1] - 24) if magnitude else 0.0


def _block_bounds(x: torch.Tensor) -> torch.Tensor:
    """Per element: half its block's step, plus float32 rounding of the block's largest magnitude."""
    x = x.double()
    bounds = torch.empty_like(x)
    for start in range(0, x.numel(), BLOCK):
        block = x[start:start + BLOCK]
        low, high = block.min().item(), block.max().item()
        bounds[start:start + BLOCK] = (high - low) / 15 / 2 * (1 + 1e-5) + 8 * _ulp32(max(-low, high))
    return bounds


@pytest.mark.parametrize("n", [1, 2, 3, 255, 256, 257, 5_001])
@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30])
def test_error_is_at_most_half_a_block_step(n: int, scale: float) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * scale
    y = decode(encode(x, KIND))
    assert bool(((y.double() - x.double()).abs() <= _block_bounds(x)).all())


def test_an_outlier_costs_only_its_own_block() -> None:
    # one range per payload would spend the 16 levels on the outlier; a block keeps it local
    x = torch.randn(10 * BLOCK, generator=torch.Generator().manual_seed(3)) * 0.01
    x[5] = 100.0
    error = (decode(encode(x, KIND)) - x).abs()
    # the outlier's block has a step of ~100/15: its small values all round to its lowest levels
    assert error[:BLOCK].max().item() > 0.01
    # every other block keeps its own step of ~0.06/15
    assert error[BLOCK:].max().item() < 0.003


def test_levels_cover_each_block_range_ends_exactly() -> None:
    x = torch.linspace(-1, 3, BLOCK)
    y = decode(encode(x, KIND))
    assert y.min().item() == -1.0
    assert y.max().item() == pytest.approx(3, abs=1e-6)
    assert len(set(y.tolist())) == 16


@pytest.mark.parametrize("value", [0.0, 0.3, -7e20])
@pytest.mark.parametrize("n", [1, 2, 1000])
def test_constant_decodes_exactly(value: float, n: int) -> None:
    x = torch.full((n,), value)
    assert torch.equal(decode(encode(x, KIND)), x)


def test_size_is_four_bits_and_a_quarter_per_element() -> None:
    n = 1 << 20
    assert len(encode(torch.randn(n), KIND)) == 16 + n // 2 + 8 * (n // BLOCK)
    assert get_codec(KIND).encoded_size(n) * 8 / n == pytest.approx(4.25, abs=1e-3)
    assert len(encode(torch.randn(3), KIND)) == 16 + 8 + 2


def test_decode_add_adds_the_weighted_decoded_values() -> None:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(7))
    payload = encode(x, KIND)
    acc = torch.ones(1001)
    decode_add(payload, acc, weight=0.5)
    assert torch.allclose(acc, 1 + 0.5 * decode(payload), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes(dtype: torch.dtype) -> None:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = decode(encode(x, KIND))
    assert y.dtype == dtype
    rounding = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float64: 0.0}[dtype]
    bound = _block_bounds(x) + rounding * x.double().abs()
    assert bool(((y.double() - x.double()).abs() <= bound).all())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_refuses_nonfinite(bad: float) -> None:
    x = torch.randn(1000)
    x[999] = bad
    with pytest.raises(CompressionError, match="NaN or inf"):
        encode(x, KIND)


def test_refuses_range_beyond_float32() -> None:
    with pytest.raises(CompressionError, match="float32"):
        encode(torch.tensor([-3e38, 3e38]), KIND)


def test_refuses_truncated_and_corrupt_payloads() -> None:
    payload = bytearray(encode(torch.randn(600), KIND))
    with pytest.raises(CompressionError, match="must be"):
        decode(bytes(payload[:-1]))
    payload[16:20] = torch.tensor([math.nan]).numpy().tobytes()  # the first block's minimum
    with pytest.raises(CompressionError, match="invalid block range"):
        decode(bytes(payload))
    out = torch.zeros(600)
    with pytest.raises(CompressionError, match="invalid block range"):
        decode_add(bytes(payload), out)
    assert torch.equal(out, torch.zeros(600))  # nothing was added
