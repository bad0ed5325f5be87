"""Tests for swarm.dht.config: defaults follow the paper, bad values fail on construction."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.core.errors import ConfigError
from swarm.dht import DHTConfig, SchemaValidator


def test_defaults_and_frozen() -> None:
    config = DHTConfig()
    assert (config.bucket_size, config.alpha, config.num_replicas) == (20, 3, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.alpha = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value",
    [("bucket_size", 0), ("alpha", 0), ("num_replicas", 0), ("request_timeout", 0), ("lookup_timeout", -1),
     ("cache_size", -1), ("storage_size", 0), ("max_keys_per_call", 0), ("blacklist_max_time", 1.0),
     ("leave_timeout", -0.5), ("leave_timeout", float("nan"))],
)
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        DHTConfig(**{field: value})


def test_validators_become_a_tuple_and_must_be_validators() -> None:
    schema = SchemaValidator({"x": int}, prefix="p_")
    assert DHTConfig(validators=[schema]).validators == (schema,)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="RecordValidator"):
        DHTConfig(validators=("not a validator",))  # type: ignore[arg-type]
