"""Policies that choose a CompressionType for each tensor, by its size or by its role.

Small tensors (biases, norms) cost little to send exactly and suffer most from quantization, so
`SizeAdaptiveCompression` sends them with one type and large ones with another (hivemind's
SizeAdaptiveCompression). What a tensor *is* matters as much: Adam's second moments underflow
plain float16, parameters need more precision than gradients. `RoleAdaptiveCompression` picks per
role, and each role may itself be any policy, so the two compose.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

from swarm.compression.base import CompressionType
from swarm.core.errors import ConfigError

__all__ = [
    "CompressionPolicy",
    "FixedCompression",
    "RoleAdaptiveCompression",
    "SizeAdaptiveCompression",
    "TensorRole",
]


class TensorRole(str, enum.Enum):
    """What a tensor is to training; a policy may compress each kind differently."""

    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"

    @classmethod
    def parse(cls, role: str | TensorRole) -> TensorRole:
        """Reads a role name; accepts plurals and spaces/hyphens ("optimizer state", "gradients").

        Raises:
            ValueError: the name is not a known role.
        """
        if isinstance(role, cls):
            return role
        if not isinstance(role, str):
            raise TypeError(f"role must be a str, got {type(role).__name__}")
        name = role.strip().lower().replace("-", "_").replace(" ", "_")
        name = _ALIASES.get(name, name)
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(member.value for member in cls)
            raise ValueError(f"unknown tensor role {role!r}; expected one of: {known}") from None


_ALIASES = {
    "parameters": "parameter",
    "params": "parameter",
    "param": "parameter",
    "gradients": "gradient",
    "grads": "gradient",
    "grad": "gradient",
    "optimizer_states": "optimizer_state",
    "optimizer": "optimizer_state",
    "state": "optimizer_state",
    "activations": "activation",
}


@runtime_checkable
class CompressionPolicy(Protocol):
    """Anything that chooses a compression type for a tensor."""

    def choose(self, tensor_numel: int, role: str = "gradient") -> CompressionType:
        """Returns the compression type for a tensor of `tensor_numel` elements with `role`."""
        ...


PolicyEntry = CompressionType | CompressionPolicy


def _check_numel(tensor_numel: int) -> None:
    if isinstance(tensor_numel, bool) or not isinstance(tensor_numel, int) or tensor_numel < 0:
        raise ValueError(f"tensor_numel must be a non-negative int, got {tensor_numel!r}")


def _as_kind(value: object, name: str) -> CompressionType:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a CompressionType, got {value!r}")
    try:
        return CompressionType(value)
    except ValueError:
        raise ValueError(f"{name}: unknown compression type {value!r}") from None


@dataclass(frozen=True)
class FixedCompression:
    """Always the same compression type.

    Attributes:
        kind: the type for every tensor.
    """

    kind: CompressionType = CompressionType.NONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _as_kind(self.kind, "kind"))

    def choose(self, tensor_numel: int, role: str = "gradient") -> CompressionType:
        """Returns `kind` (after checking the arguments)."""
        _check_numel(tensor_numel)
        TensorRole.parse(role)
        return self.kind


@dataclass(frozen=True)
class SizeAdaptiveCompression:
    """One type for tensors with fewer than `threshold` elements, another for the rest.

    Attributes:
        threshold: tensors with `numel < threshold` use `small`; `numel >= threshold` use `large`.
        small: type for small tensors (default NONE: they are cheap to send exactly).
        large: type for large tensors (default FLOAT16).
    """

    threshold: int = 1 << 16
    small: CompressionType = CompressionType.NONE
    large: CompressionType = CompressionType.FLOAT16

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold < 0:
            raise ConfigError(f"threshold must be a non-negative int, got {self.threshold!r}")
        object.__setattr__(self, "small", _as_kind(self.small, "small"))
        object.__setattr__(self, "large", _as_kind(self.large, "large"))

    def choose(self, tensor_numel: int, role: str = "gradient") -> CompressionType:
        """Returns `small` if `tensor_numel < threshold`, else `large`; `role` is only checked.

        Raises:
            ValueError: negative `tensor_numel` or unknown role.
        """
        _check_numel(tensor_numel)
        TensorRole.parse(role)
        return self.small if tensor_numel < self.threshold else self.large


@dataclass(frozen=True)
class RoleAdaptiveCompression:
    """A compression type, or a nested policy, per tensor role.

    Each attribute is a CompressionType or any `CompressionPolicy` (for example a
    `SizeAdaptiveCompression`), which then decides for that role.

    Attributes:
        parameter: model parameters (default NONE: averaged weights need full precision).
        gradient: gradients and pseudo-gradients (default SCALED_FLOAT16: small gradients would
            underflow plain float16).
        optimizer_state: optimizer statistics (default SCALED_FLOAT16: Adam's second moments are
            squares of gradients, far below float16's range).
        activation: activations and their gradients between experts (default FLOAT16).
    """

    parameter: PolicyEntry = CompressionType.NONE
    gradient: PolicyEntry = CompressionType.SCALED_FLOAT16
    optimizer_state: PolicyEntry = CompressionType.SCALED_FLOAT16
    activation: PolicyEntry = CompressionType.FLOAT16

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) and isinstance(value, CompressionPolicy):
                continue  # a nested policy
            object.__setattr__(self, field.name, _as_kind(value, field.name))

    def choose(self, tensor_numel: int, role: str = "gradient") -> CompressionType:
        """Returns the type for `role`, asking the role's nested policy where it has one.

        Raises:
            ValueError: negative `tensor_numel` or unknown role.
        """
        _check_numel(tensor_numel)
        parsed = TensorRole.parse(role)
        entry = {
            TensorRole.PARAMETER: self.parameter, TensorRole.GRADIENT: self.gradient,
            TensorRole.OPTIMIZER_STATE: self.optimizer_state, TensorRole.ACTIVATION: self.activation,
        }[parsed]
        if isinstance(entry, CompressionType):
            return entry
        return CompressionType(entry.choose(tensor_numel, parsed.value))
