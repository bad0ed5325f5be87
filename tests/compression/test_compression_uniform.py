"""UNIFORM_8BIT: error within half a step, exact constants, refused non-finite input."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.compression import CompressionError, CompressionType, decode, encode

KIND = CompressionType.UNIFORM_8BIT


def _ulp32(magnitude: float) -> float:
    return math.ldexp(1.0, math.frexp(magnitude)[1] - 24)


def _data(kind: str, n: int = 50_000, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return {
        "normal": lambda: torch.randn(n, generator=generator),
        "uniform": lambda: torch.rand(n, generator=generator) * 8 - 3,
        "tiny": lambda: torch.randn(n, generator=generator) * 1e-30,
        "large": lambda: torch.randn(n, generator=generator) * 1e30,
        "offset": lambda: 1000 + torch.rand(n, generator=generator) * 1e-2,
        "narrow": lambda: 1000 + torch.randint(0, 3, (n,), generator=generator) * 6.1035156e-05,
    }[kind]()


def _bound(x: torch.Tensor) -> float:
    low, high = x.min().item(), x.max().item()
    return (high - low) / 255 / 2 * (1 + 1e-5) + 4 * _ulp32(max(-low, high))


@pytest.mark.parametrize("kind", ["normal", "uniform", "tiny", "large", "offset", "narrow"])
def test_error_is_at_most_half_a_step(kind: str) -> None:
    x = _data(kind)
    y = decode(encode(x, KIND))
    assert (y - x).abs().max().item() <= _bound(x)


def test_levels_cover_the_range_ends_exactly() -> None:
    x = torch.linspace(-1, 3, 1001)
    y = decode(encode(x, KIND))
    assert y.min().item() == pytest.approx(-1, abs=1e-6)
    assert y.max().item() == pytest.approx(3, abs=1e-6)
    assert len(set(y.tolist())) == 256


@pytest.mark.parametrize("value", [0.0, 0.3, -7e20])
@pytest.mark.parametrize("n", [1, 2, 1000])
def test_constant_decodes_exactly_without_nan(value: float, n: int) -> None:
    x = torch.full((n,), value)
    y = decode(encode(x, KIND))
    assert not torch.isnan(y).any()
    assert torch.equal(y, x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_input_dtypes(dtype: torch.dtype) -> None:
    x = _data("normal", 5000).to(dtype)
    y = decode(encode(x, KIND))
    assert y.dtype == dtype
    reference = x.double()
    step = (reference.max() - reference.min()).item() / 255
    rounding = {torch.float16: 2**-11, torch.bfloat16: 2**-8, torch.float64: 2**-23}[dtype]
    assert (y.double() - reference).abs().max().item() <= step / 2 + rounding * reference.abs().max().item()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_refuses_nonfinite(bad: float) -> None:
    x = torch.randn(1000)
    x[999] = bad
    with pytest.raises(CompressionError, match="NaN or inf"):
        encode(x, KIND)


def test_refuses_range_beyond_float32() -> None:
    with pytest.raises(CompressionError, match="float32"):
        encode(torch.tensor([-3e38, 3e38]), KIND)
    with pytest.raises(CompressionError, match="float32"):
        encode(torch.tensor([1e300, 1.0], dtype=torch.float64), KIND)


def test_large_tensor_spanning_several_pieces() -> None:
    x = _data("normal", (1 << 20) + 12345, seed=5)
    y = decode(encode(x, KIND))
    assert (y - x).abs().max().item() <= _bound(x)
