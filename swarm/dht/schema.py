"""`SchemaValidator`: pydantic types that constrain the DHT values under a key prefix.

Kept apart from `validation.py` so that a peer imports pydantic only when it uses a schema.
"""

from __future__ import annotations

import collections.abc
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import pydantic

from swarm.core.errors import ValidationError
from swarm.dht.keys import NO_SUBKEY, deserialize_subkey, hash_serialized_key, serialize_key
from swarm.dht.validation import DHTRecord, RecordValidator, original_key

_MAPPING_ORIGINS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)


@dataclass(frozen=True)
class _Field:
    key: str
    value: pydantic.TypeAdapter[Any]
    subkey: pydantic.TypeAdapter[Any] | None  # set for dictionary fields only
    item: pydantic.TypeAdapter[Any] | None


class SchemaValidator(RecordValidator):
    """Constrains the values of keys under a prefix with pydantic types.

    The schema names keys after the prefix: either a pydantic model whose fields are the key
    names (hivemind-style), or a mapping from key name to type. With `prefix="run1_"` and
    `{"progress": Progress, "peers": dict[str, PeerInfo]}`:

    - a plain value under "run1_progress" must validate as `Progress`;
    - a subkey of "run1_peers" must validate as `str` and its value as `PeerInfo`; a plain
      value there must validate as the whole `dict[str, PeerInfo]`; a field whose type is not
      a dict (`dict`, `Mapping`) takes no subkeys;
    - any other key starting with "run1_" is rejected unless `allow_extra_keys`;
    - keys not starting with the prefix are not this validator's business.

    Values are msgpack-decoded, then validated in pydantic's strict mode by default ("5" is not
    an int; tuples arrive as lists, so declare lists). Fields inside a model are checked as
    the model declares; give models `extra="forbid"` to refuse unknown fields. An empty prefix
    makes the schema govern every key.

    Args:
        schema: A pydantic model class, or a mapping of key name to type.
        prefix: The string every governed key starts with.
        allow_extra_keys: Accept keys under the prefix that the schema does not name.
        strict: Validate in pydantic's strict mode.
    """

    priority = 0

    def __init__(
        self,
        schema: type[pydantic.BaseModel] | Mapping[str, Any],
        prefix: str = "",
        *,
        allow_extra_keys: bool = False,
        strict: bool = True,
    ) -> None:
        if isinstance(schema, type) and issubclass(schema, pydantic.BaseModel):
            types = {name: field.annotation for name, field in schema.model_fields.items()}
        elif isinstance(schema, Mapping):
            types = dict(schema)
        else:
            raise TypeError(f"schema must be a pydantic model class or a mapping, got {schema!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be str, got {type(prefix).__name__}")
        self.prefix = prefix
        self.allow_extra_keys = allow_extra_keys
        self.strict = strict
        self._fields: dict[str, _Field] = {}
        self._by_key_id: dict[bytes, _Field] = {}
        for name, annotation in types.items():
            field = _make_field(prefix + name, annotation)
            self._fields[name] = field
            for key in (field.key, field.key.encode()):  # str and bytes spellings of the key
                self._by_key_id[hash_serialized_key(serialize_key(key))] = field

    def _field_for(self, record: DHTRecord) -> _Field | None:
        original = original_key(record)
        if original is None:
            return self._by_key_id.get(record.key)
        if isinstance(original, bytes):
            try:
                original = original.decode()
            except UnicodeDecodeError:
                return None
        if not original.startswith(self.prefix):
            return None
        field = self._fields.get(original[len(self.prefix) :])
        if field is None and not self.allow_extra_keys:
            raise ValidationError(f"key {original!r} is under prefix {self.prefix!r} but not in the schema")
        return field

    def validate(self, record: DHTRecord) -> None:
        field = self._field_for(record)
        if field is None:
            return
        try:
            value = msgpack.unpackb(record.value, raw=False)
        except (ValueError, TypeError) as e:  # msgpack's errors for bad input
            raise ValidationError(f"value of key {field.key!r} is not msgpack: {e}") from e
        try:
            if record.subkey == NO_SUBKEY:
                field.value.validate_python(value, strict=self.strict)
                return
            if field.subkey is None or field.item is None:
                raise ValidationError(f"key {field.key!r} holds a plain value, not a dictionary of subkeys")
            try:
                subkey = deserialize_subkey(record.subkey)
            except ValueError as e:
                raise ValidationError(f"subkey of key {field.key!r}: {e}") from e
            field.subkey.validate_python(subkey, strict=self.strict)
            field.item.validate_python(value, strict=self.strict)
        except pydantic.ValidationError as e:
            raise ValidationError(f"key {field.key!r} violates the schema: {e}") from e


def _make_field(key: str, annotation: Any) -> _Field:  # Any: a type form, as pydantic takes it
    origin = typing.get_origin(annotation)
    if origin in _MAPPING_ORIGINS or annotation in _MAPPING_ORIGINS:
        args = typing.get_args(annotation) or (Any, Any)
        return _Field(
            key,
            pydantic.TypeAdapter(annotation),
            pydantic.TypeAdapter(args[0]),
            pydantic.TypeAdapter(args[1]),
        )
    return _Field(key, pydantic.TypeAdapter(annotation), None, None)
