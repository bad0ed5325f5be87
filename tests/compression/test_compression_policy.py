"""Compression policies: by tensor size and by tensor role."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.compression import (
    CompressionPolicy,
    CompressionType,
    FixedCompression,
    RoleAdaptiveCompression,
    SizeAdaptiveCompression,
    TensorRole,
)


def test_size_adaptive_switches_at_the_threshold() -> None:
    policy = SizeAdaptiveCompression(
        threshold=1000, small=CompressionType.FLOAT16, large=CompressionType.UNIFORM_8BIT
    )
    assert policy.choose(0) == CompressionType.FLOAT16
    assert policy.choose(999) == CompressionType.FLOAT16
    assert policy.choose(1000) == CompressionType.UNIFORM_8BIT
    assert policy.choose(10**9, role="parameter") == CompressionType.UNIFORM_8BIT


def test_size_adaptive_defaults() -> None:
    policy = SizeAdaptiveCompression()
    assert policy.choose(100) == CompressionType.NONE
    assert policy.choose(1 << 16) == CompressionType.FLOAT16


def test_role_adaptive_defaults() -> None:
    policy = RoleAdaptiveCompression()
    assert policy.choose(10) == CompressionType.SCALED_FLOAT16  # role defaults to "gradient"
    assert policy.choose(10, "parameter") == CompressionType.NONE
    assert policy.choose(10, "optimizer_state") == CompressionType.SCALED_FLOAT16
    assert policy.choose(10, "activation") == CompressionType.FLOAT16


def test_role_adaptive_nests_other_policies() -> None:
    policy = RoleAdaptiveCompression(
        gradient=SizeAdaptiveCompression(
            threshold=100, small=CompressionType.NONE, large=CompressionType.QUANTILE_8BIT
        ),
        activation=CompressionType.UNIFORM_8BIT,
    )
    assert policy.choose(99, "gradient") == CompressionType.NONE
    assert policy.choose(100, "gradient") == CompressionType.QUANTILE_8BIT
    assert policy.choose(100, TensorRole.ACTIVATION) == CompressionType.UNIFORM_8BIT


@pytest.mark.parametrize(
    ("name", "role"),
    [
        ("parameters", TensorRole.PARAMETER),
        ("Gradients", TensorRole.GRADIENT),
        ("optimizer state", TensorRole.OPTIMIZER_STATE),
        ("optimizer-state", TensorRole.OPTIMIZER_STATE),
        ("activations", TensorRole.ACTIVATION),
        (TensorRole.GRADIENT, TensorRole.GRADIENT),
    ],
)
def test_role_names(name: str, role: TensorRole) -> None:
    assert TensorRole.parse(name) is role


def test_invalid_arguments_are_refused() -> None:
    for policy in (SizeAdaptiveCompression(), RoleAdaptiveCompression(), FixedCompression()):
        with pytest.raises(ValueError, match="role"):
            policy.choose(10, "weights")
        with pytest.raises(ValueError, match="numel"):
            policy.choose(-1)
    with pytest.raises(ValueError):
        SizeAdaptiveCompression(threshold=-5)
    with pytest.raises(ValueError):
        SizeAdaptiveCompression(small=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RoleAdaptiveCompression(gradient="fast")  # type: ignore[arg-type]


def test_policies_are_frozen_and_coerce_ints() -> None:
    policy = SizeAdaptiveCompression(small=1, large=3)  # type: ignore[arg-type]
    assert policy.small is CompressionType.FLOAT16 and policy.large is CompressionType.UNIFORM_8BIT
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.threshold = 5  # type: ignore[misc]


def test_fixed_and_protocol() -> None:
    assert (
        FixedCompression(CompressionType.QUANTILE_8BIT).choose(5, "activation")
        == CompressionType.QUANTILE_8BIT
    )
    for policy in (FixedCompression(), SizeAdaptiveCompression(), RoleAdaptiveCompression()):
        assert isinstance(policy, CompressionPolicy)
