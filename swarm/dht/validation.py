"""Record validators: who may write a DHT record, and what it may hold.

A validator sees every record a node is asked to store (receiver side), every record a
client is about to send (sender side: `sign_value` may wrap the value, `validate` catches
mistakes early), and every record a lookup returns (getter side), and rejects bad ones with a
`ValidationError` that says why. `CompositeValidator` chains several.

Keys travel hashed (`DHTRecord.key` is the 32-byte DHT key), so a receiver cannot read an owner
marker or a schema name out of the key alone. Decision: a record carries the serialized
original key too (`DHTRecord.raw_key`, the bytes hashed into `key`); validators check that it
hashes to `key` and read markers and names from it. The wire protocol must therefore send the
original key with every store. `SignatureValidator` rejects records without it by default
(otherwise a writer could dodge a key's owner simply by leaving it out); subkeys travel in the
clear and need nothing extra. `SchemaValidator` recognizes its own keys by hash even without
`raw_key`, but can only refuse keys missing from the schema when it sees the original key.
"""

from __future__ import annotations

import dataclasses
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import msgpack

from swarm.core.errors import IdentityError, ValidationError
from swarm.core.identity import Identity, peer_id_to_public_key, verify
from swarm.dht.keys import (
    Key,
    Subkey,
    deserialize_key,
    hash_serialized_key,
    serialize_key,
    serialize_subkey,
)


@dataclass(frozen=True)
class DHTRecord:
    """One value as it is stored: a plain value, or one subkey of a dictionary value.

    Attributes:
        key: The 32-byte DHT key (`DHTID.from_key(original_key).to_bytes()`).
        subkey: The serialized subkey (`serialize_subkey`), empty for a plain value.
        value: The serialized value (msgpack), possibly wrapped by validators.
        expiration_time: When the value stops existing (seconds since the epoch).
        raw_key: The serialized original key (`serialize_key`), whose sha256 is `key`;
            None where it is unknown.
    """

    key: bytes
    subkey: bytes
    value: bytes
    expiration_time: float
    raw_key: bytes | None = None

    @classmethod
    def create(cls, key: Key, value: object, expiration_time: float, subkey: Subkey | None = None) -> DHTRecord:
        """The record a client builds from user data (value serialized with msgpack)."""
        raw_key = serialize_key(key)
        return cls(
            key=hash_serialized_key(raw_key),
            subkey=serialize_subkey(subkey),
            value=msgpack.packb(value, use_bin_type=True),
            expiration_time=float(expiration_time),
            raw_key=raw_key,
        )


class RecordValidator(ABC):
    """A rule every DHT record must pass.

    `priority` orders validators in a `CompositeValidator`: `sign_value` runs from the lowest
    priority to the highest (so the highest wraps the value last, outermost), `validate` and
    `strip_value` from the highest to the lowest (each peels its own wrapping off before
    handing the value on).
    """

    priority: int = 0

    @abstractmethod
    def validate(self, record: DHTRecord) -> None:
        """Returns if `record` is acceptable.

        Raises:
            ValidationError: With the reason the record is rejected.
        """

    def sign_value(self, record: DHTRecord) -> bytes:
        """The value to send for an outgoing record (for example, with a signature attached)."""
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        """The value with whatever `sign_value` attached removed."""
        return record.value


class CompositeValidator(RecordValidator):
    """Several validators applied as one: a record must pass all of them."""

    def __init__(self, validators: Iterable[RecordValidator] = ()) -> None:
        self._validators: list[RecordValidator] = []
        self.extend(validators)

    @property
    def validators(self) -> tuple[RecordValidator, ...]:
        """The validators, lowest priority first (ties keep insertion order)."""
        return tuple(self._validators)

    def extend(self, validators: Iterable[RecordValidator]) -> None:
        for validator in validators:
            if not isinstance(validator, RecordValidator):
                raise TypeError(f"not a RecordValidator: {validator!r}")
            self._validators.append(validator)
        self._validators.sort(key=lambda validator: validator.priority)

    def validate(self, record: DHTRecord) -> None:
        validators = self._validators
        for position in range(len(validators) - 1, -1, -1):  # outermost first
            validator = validators[position]
            validator.validate(record)
            if position:  # the next one checks what this one wraps
                record = dataclasses.replace(record, value=validator.strip_value(record))

    def sign_value(self, record: DHTRecord) -> bytes:
        for validator in self._validators:
            record = dataclasses.replace(record, value=validator.sign_value(record))
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        for validator in reversed(self._validators):
            record = dataclasses.replace(record, value=validator.strip_value(record))
        return record.value


def original_key(record: DHTRecord) -> Key | None:
    """The user's key from `record.raw_key` (None if absent), checked against `record.key`."""
    if record.raw_key is None:
        return None
    if hash_serialized_key(record.raw_key) != record.key:
        raise ValidationError("the record's original key does not hash to its DHT key")
    try:
        return deserialize_key(record.raw_key)
    except ValueError as e:
        raise ValidationError(str(e)) from e


# --- owner signatures --------------------------------------------------------------------

_OWNER_MARKER = re.compile(rb"\[owner:([^\]]*)\]")
_SIGNING_CONTEXT = "swarm.dht.signed-record/v1"
_SIGNATURE_BYTES = 64  # Ed25519


def owner_marker(peer_id: str) -> str:
    """The marker that makes a key or subkey writable only by `peer_id`: `[owner:<PeerID>]`.

    Example: `dht.store("alice_status" + owner_marker(peer.peer_id), ...)`.

    Raises:
        ValueError: `peer_id` is not an Ed25519 PeerID.
    """
    try:
        peer_id_to_public_key(peer_id)
    except IdentityError as e:
        raise ValueError(str(e)) from e
    return f"[owner:{peer_id}]"


_WHOLE_MARKER = re.compile(r"\[owner:([1-9A-HJ-NP-Za-km-z]{1,128})\]")


def marker_owner(subkey: object) -> str | None:
    """The PeerID of a subkey that is exactly one `owner_marker`, else None.

    Records a peer makes about itself (progress reports, averaging sign-ups) use its marker as the
    subkey: nodes then store them only with that peer's signature, and readers take the writer's
    PeerID from the subkey with this, ignoring any entry under a subkey that is not a marker
    (anyone may write those).
    """
    if not isinstance(subkey, str):
        return None
    match = _WHOLE_MARKER.fullmatch(subkey)
    return match.group(1) if match is not None else None


def signed_bytes(record: DHTRecord, payload: bytes) -> bytes:
    """What an owner signs: key, subkey, unwrapped value and expiration, as one msgpack array.

    Binding all four (plus a context string) means a signature cannot be replayed onto any
    other key, subkey, value or expiration time, nor confused with other signed swarm data.
    """
    return msgpack.packb(
        [_SIGNING_CONTEXT, record.key, record.subkey, payload, float(record.expiration_time)],
        use_bin_type=True,
    )


def _unpack_signed(value: bytes) -> tuple[bytes, bytes] | None:
    """(payload, signature) from a signed value, or None if it is not one."""
    try:
        envelope = msgpack.unpackb(value, raw=False)
    except (ValueError, TypeError):  # msgpack's errors for bad input
        return None
    if (
        isinstance(envelope, list)
        and len(envelope) == 2
        and isinstance(envelope[0], bytes)
        and isinstance(envelope[1], bytes)
        and len(envelope[1]) == _SIGNATURE_BYTES
    ):
        return envelope[0], envelope[1]
    return None


def _single_owner(record: DHTRecord) -> str | None:
    """The owner named by the markers in the original key (where known) and the subkey."""
    owners = set(_OWNER_MARKER.findall(record.raw_key or b""))
    owners.update(_OWNER_MARKER.findall(record.subkey))
    if len(owners) > 1:
        names = ", ".join(sorted(owner.decode("utf-8", "replace") for owner in owners))
        raise ValidationError(f"the key and subkey name different owners ({names})")
    return owners.pop().decode("utf-8", "replace") if owners else None


def record_owner(record: DHTRecord) -> str | None:
    """The PeerID `record`'s key or subkey names as owner (`owner_marker`), or None.

    Raises:
        ValidationError: The key and subkey name different owners.
    """
    return _single_owner(record)


class SignatureValidator(RecordValidator):
    """Protected records: a key or subkey holding `[owner:<PeerID>]` is writable only by that peer.

    Format: the value of a protected record is `msgpack([payload, signature])`, where `payload`
    is the value as it was before signing and `signature` is the owner's Ed25519 signature over
    `signed_bytes(record, payload)`. Records without a marker pass untouched. A key and subkey
    naming two different owners are rejected.

    Args:
        identity: This peer's identity, to sign records it owns; None to only validate.
        require_raw_key: Reject records whose original key is unknown, since an owner marker in
            the key could not be seen (see the module docstring). Set False only where records
            never carry it, accepting that key markers then protect nothing.
    """

    priority = 10  # outermost: sign after, and verify before, every other validator

    def __init__(self, identity: Identity | None = None, *, require_raw_key: bool = True) -> None:
        self.identity = identity
        self.require_raw_key = require_raw_key

    @property
    def local_owner_marker(self) -> str:
        """`owner_marker` of this validator's identity."""
        if self.identity is None:
            raise ValueError("this SignatureValidator has no identity")
        return owner_marker(self.identity.peer_id)

    def owner_of(self, record: DHTRecord) -> str | None:
        """The PeerID a record's key or subkey names as owner, or None if it names none.

        Raises:
            ValidationError: The original key is missing (when required) or does not match,
                or the key and subkey name different owners.
        """
        if record.raw_key is None and self.require_raw_key:
            raise ValidationError("the record's original key is missing, so its owner cannot be checked")
        original_key(record)
        return _single_owner(record)

    def validate(self, record: DHTRecord) -> None:
        owner = self.owner_of(record)
        if owner is None:
            return
        try:
            peer_id_to_public_key(owner)
        except IdentityError as e:
            raise ValidationError(f"the owner marker names no valid PeerID: {e}") from e
        signed = _unpack_signed(record.value)
        if signed is None:
            raise ValidationError(f"record owned by {owner} carries no signature")
        payload, signature = signed
        if not verify(owner, signed_bytes(record, payload), signature):
            raise ValidationError(
                f"the signature is not {owner}'s over this key, subkey, value and expiration"
            )

    def sign_value(self, record: DHTRecord) -> bytes:
        """Signs `record.value` (unsigned) if this validator's identity owns the record.

        Records owned by others come back unchanged (a value already signed by its owner can
        be forwarded), as do records with no owner; `validate` says what is wrong with them.
        """
        try:
            owner = _single_owner(record)
        except ValidationError:
            return record.value
        if owner is None or self.identity is None or owner != self.identity.peer_id:
            return record.value
        signature = self.identity.sign(signed_bytes(record, record.value))
        return msgpack.packb([record.value, signature], use_bin_type=True)

    def strip_value(self, record: DHTRecord) -> bytes:
        try:
            owner = _single_owner(record)
        except ValidationError:
            return record.value
        if owner is None:
            return record.value
        signed = _unpack_signed(record.value)
        return record.value if signed is None else signed[0]

