"""Tests for swarm.dht.validation: owner signatures, schemas, and their composition."""

from __future__ import annotations

import dataclasses

import msgpack
import pydantic
import pytest

from swarm.core.errors import ValidationError
from swarm.core.identity import Identity
from swarm.dht.ids import DHTID
from swarm.dht.keys import serialize_key, serialize_subkey
from swarm.dht.schema import SchemaValidator
from swarm.dht.validation import (
    CompositeValidator,
    DHTRecord,
    RecordValidator,
    SignatureValidator,
    owner_marker,
    signed_bytes,
)

ALICE = Identity.from_seed(b"a" * 32)
BOB = Identity.from_seed(b"b" * 32)
EXPIRES = 1_000_000.0


def signed(identity: Identity, key: str, value: object, subkey: object = None) -> DHTRecord:
    record = DHTRecord.create(key, value, EXPIRES, subkey=subkey)
    return dataclasses.replace(record, value=SignatureValidator(identity).sign_value(record))


def rebind(record: DHTRecord, key: str) -> DHTRecord:
    """The same value and signature moved onto another key."""
    other = DHTRecord.create(key, None, record.expiration_time)
    return dataclasses.replace(record, key=other.key, raw_key=other.raw_key)


def test_record_create_hashes_key_like_dhtid() -> None:
    record = DHTRecord.create("k", {"x": 1}, 5, subkey="s")
    assert record.key == DHTID.from_key("k").to_bytes()
    assert record.raw_key == serialize_key("k")
    assert record.subkey == serialize_subkey("s")
    assert msgpack.unpackb(record.value) == {"x": 1}
    assert DHTRecord.create("k", 1, 5).subkey == b""


# --- signatures --------------------------------------------------------------------------


def test_owner_marker_names_a_valid_peer_id() -> None:
    assert owner_marker(ALICE.peer_id) == f"[owner:{ALICE.peer_id}]"
    assert SignatureValidator(ALICE).local_owner_marker == owner_marker(ALICE.peer_id)
    with pytest.raises(ValueError):
        owner_marker("not-a-peer-id")
    with pytest.raises(ValueError):
        SignatureValidator().local_owner_marker  # noqa: B018


def test_unprotected_records_pass_untouched() -> None:
    validator = SignatureValidator(ALICE)
    record = DHTRecord.create("plain", [1, 2], EXPIRES, subkey="s")
    assert validator.sign_value(record) == record.value
    assert validator.strip_value(record) == record.value
    validator.validate(record)


def test_owner_signed_records_are_accepted_and_stripped() -> None:
    validator = SignatureValidator()  # a receiver: validates without an identity
    key = "status" + owner_marker(ALICE.peer_id)
    record = signed(ALICE, key, {"step": 3})
    assert record.value != msgpack.packb({"step": 3})
    validator.validate(record)
    assert msgpack.unpackb(validator.strip_value(record)) == {"step": 3}
    by_subkey = signed(ALICE, "peers", "addr", subkey=owner_marker(ALICE.peer_id))
    validator.validate(by_subkey)
    both = signed(ALICE, key, "v", subkey="x" + owner_marker(ALICE.peer_id))
    validator.validate(both)


def test_missing_signature_is_rejected() -> None:
    record = DHTRecord.create("k" + owner_marker(ALICE.peer_id), "v", EXPIRES)
    with pytest.raises(ValidationError, match="no signature"):
        SignatureValidator().validate(record)


def test_forged_signature_is_rejected() -> None:
    record = signed(ALICE, "k" + owner_marker(ALICE.peer_id), "v")
    payload, signature = msgpack.unpackb(record.value)
    forged = bytes([signature[0] ^ 1]) + signature[1:]
    for value in (
        msgpack.packb([payload, forged], use_bin_type=True),
        msgpack.packb([payload, bytes(64)], use_bin_type=True),
    ):
        with pytest.raises(ValidationError, match="signature is not"):
            SignatureValidator().validate(dataclasses.replace(record, value=value))


def test_signature_by_someone_else_is_rejected() -> None:
    key = "k" + owner_marker(ALICE.peer_id)
    # Bob's validator will not sign Alice's record...
    record = DHTRecord.create(key, "v", EXPIRES)
    assert SignatureValidator(BOB).sign_value(record) == record.value
    # ...and a value Bob signs by hand does not pass as Alice's.
    signature = BOB.sign(signed_bytes(record, record.value))
    forged = dataclasses.replace(record, value=msgpack.packb([record.value, signature], use_bin_type=True))
    with pytest.raises(ValidationError, match=ALICE.peer_id):
        SignatureValidator().validate(forged)


@pytest.mark.parametrize("field", ["key", "subkey", "value", "expiration_time"])
def test_signature_cannot_be_replayed_onto_another_record(field: str) -> None:
    marker = owner_marker(ALICE.peer_id)
    record = signed(ALICE, "k" + marker, "v", subkey="s")
    SignatureValidator().validate(record)
    if field == "key":
        replayed = rebind(record, "other" + marker)
    elif field == "subkey":
        replayed = dataclasses.replace(record, subkey=serialize_subkey("t"))
    elif field == "value":
        _, signature = msgpack.unpackb(record.value)
        other_payload = msgpack.packb("evil", use_bin_type=True)
        replayed = dataclasses.replace(
            record, value=msgpack.packb([other_payload, signature], use_bin_type=True)
        )
    else:
        replayed = dataclasses.replace(record, expiration_time=record.expiration_time + 1e6)
    with pytest.raises(ValidationError, match="signature is not"):
        SignatureValidator().validate(replayed)


def test_different_owners_in_key_and_subkey_are_rejected() -> None:
    record = signed(ALICE, "k" + owner_marker(ALICE.peer_id), "v", subkey=owner_marker(BOB.peer_id))
    with pytest.raises(ValidationError, match="different owners"):
        SignatureValidator().validate(record)


def test_malformed_owner_marker_makes_the_key_unwritable() -> None:
    record = DHTRecord.create("k[owner:0OIl]", "v", EXPIRES)
    with pytest.raises(ValidationError, match="no valid PeerID"):
        SignatureValidator().validate(record)


def test_original_key_must_travel_and_match() -> None:
    record = signed(ALICE, "k" + owner_marker(ALICE.peer_id), "v")
    without_key = dataclasses.replace(record, raw_key=None)
    with pytest.raises(ValidationError, match="original key is missing"):
        SignatureValidator().validate(without_key)
    # Dodging the owner by sending the protected key's hash with an innocent original key:
    lying = dataclasses.replace(record, raw_key=serialize_key("innocent"), value=msgpack.packb("evil"))
    with pytest.raises(ValidationError, match="does not hash"):
        SignatureValidator().validate(lying)
    # Where records never carry it, subkey markers still protect:
    lenient = SignatureValidator(require_raw_key=False)
    lenient.validate(without_key)  # the key's marker is invisible: accepted (documented risk)
    sub = dataclasses.replace(
        DHTRecord.create("k", "v", EXPIRES, subkey=owner_marker(ALICE.peer_id)), raw_key=None
    )
    with pytest.raises(ValidationError, match="no signature"):
        lenient.validate(sub)


# --- schemas -----------------------------------------------------------------------------


class Progress(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    step: int
    loss: float


class Schema(pydantic.BaseModel):
    progress: Progress
    peers: dict[str, int]
    name: str


@pytest.fixture(params=["model", "mapping"])
def schema_validator(request: pytest.FixtureRequest) -> SchemaValidator:
    if request.param == "model":
        return SchemaValidator(Schema, prefix="run1_")
    return SchemaValidator({"progress": Progress, "peers": dict[str, int], "name": str}, prefix="run1_")


def test_schema_accepts_valid_records(schema_validator: SchemaValidator) -> None:
    schema_validator.validate(DHTRecord.create("run1_progress", {"step": 1, "loss": 0.5}, EXPIRES))
    schema_validator.validate(DHTRecord.create("run1_progress", {"step": 1, "loss": 1}, EXPIRES))
    schema_validator.validate(DHTRecord.create("run1_peers", 7, EXPIRES, subkey="alice"))
    schema_validator.validate(DHTRecord.create("run1_peers", {"a": 1}, EXPIRES))  # whole dict
    schema_validator.validate(DHTRecord.create(b"run1_name", "n", EXPIRES))  # bytes key too
    schema_validator.validate(DHTRecord.create("run2_progress", "anything", EXPIRES))  # not ours


@pytest.mark.parametrize(
    ("key", "value", "subkey", "reason"),
    [
        ("run1_progress", {"step": "1", "loss": 0.5}, None, "violates the schema"),  # str for int
        ("run1_progress", {"step": 1}, None, "violates the schema"),  # missing field
        ("run1_progress", {"step": 1, "loss": 0.5, "x": 1}, None, "violates the schema"),  # extra field
        ("run1_progress", [1, 0.5], None, "violates the schema"),
        ("run1_name", 5, None, "violates the schema"),
        ("run1_peers", "seven", "alice", "violates the schema"),  # subkey value type
        ("run1_peers", 7, 3, "violates the schema"),  # subkey type
        ("run1_name", "n", "sub", "not a dictionary"),  # subkeys on a plain field
        ("run1_unknown", 1, None, "not in the schema"),  # extra key under the prefix
    ],
)
def test_schema_rejects_violations(
    schema_validator: SchemaValidator, key: str, value: object, subkey: object, reason: str
) -> None:
    with pytest.raises(ValidationError, match=reason):
        schema_validator.validate(DHTRecord.create(key, value, EXPIRES, subkey=subkey))


def test_schema_extra_keys_can_be_allowed_and_strictness_relaxed() -> None:
    validator = SchemaValidator(Schema, prefix="run1_", allow_extra_keys=True, strict=False)
    validator.validate(DHTRecord.create("run1_unknown", 1, EXPIRES))
    validator.validate(DHTRecord.create("run1_progress", {"step": "1", "loss": 0.5}, EXPIRES))


def test_schema_recognizes_its_keys_by_hash_when_original_key_is_absent() -> None:
    validator = SchemaValidator(Schema, prefix="run1_")
    bad = dataclasses.replace(DHTRecord.create("run1_name", 5, EXPIRES), raw_key=None)
    with pytest.raises(ValidationError, match="violates the schema"):
        validator.validate(bad)
    validator.validate(dataclasses.replace(DHTRecord.create("run1_unknown", 5, EXPIRES), raw_key=None))


def test_schema_rejects_undecodable_values_and_bad_schemas() -> None:
    validator = SchemaValidator(Schema, prefix="run1_")
    record = dataclasses.replace(DHTRecord.create("run1_name", "n", EXPIRES), value=b"\xc1")
    with pytest.raises(ValidationError, match="not msgpack"):
        validator.validate(record)
    with pytest.raises(TypeError):
        SchemaValidator(42)  # type: ignore[arg-type]


# --- composition -------------------------------------------------------------------------


class Tagger(RecordValidator):
    """Wraps values in a tag; records the order of calls."""

    def __init__(self, tag: bytes, priority: int, log: list[str]) -> None:
        self.tag = tag
        self.priority = priority
        self.log = log

    def validate(self, record: DHTRecord) -> None:
        self.log.append(f"validate {self.tag.decode()}")
        if not record.value.startswith(self.tag):
            raise ValidationError(f"missing tag {self.tag!r}")

    def sign_value(self, record: DHTRecord) -> bytes:
        self.log.append(f"sign {self.tag.decode()}")
        return self.tag + record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value.removeprefix(self.tag)


def test_composite_signs_in_priority_order_and_validates_in_reverse() -> None:
    log: list[str] = []
    low, high = Tagger(b"L", 1, log), Tagger(b"H", 5, log)
    composite = CompositeValidator([high, low])
    assert composite.validators == (low, high)
    record = DHTRecord(b"k", b"", b"v", EXPIRES)
    value = composite.sign_value(record)
    assert value == b"HLv"  # the highest priority wraps last (outermost)
    composite.validate(dataclasses.replace(record, value=value))
    assert log == ["sign L", "sign H", "validate H", "validate L"]
    assert composite.strip_value(dataclasses.replace(record, value=value)) == b"v"
    with pytest.raises(ValidationError, match="missing tag b'H'"):
        composite.validate(dataclasses.replace(record, value=b"Lv"))
    with pytest.raises(TypeError):
        CompositeValidator([object()])  # type: ignore[list-item]


def test_composite_of_signature_and_schema_end_to_end() -> None:
    key = "run1_progress" + owner_marker(ALICE.peer_id)
    schema = SchemaValidator({"progress" + owner_marker(ALICE.peer_id): Progress}, prefix="run1_")
    sender = CompositeValidator([schema, SignatureValidator(ALICE)])
    receiver = CompositeValidator([SignatureValidator(), schema])
    record = DHTRecord.create(key, {"step": 2, "loss": 0.1}, EXPIRES)
    outgoing = dataclasses.replace(record, value=sender.sign_value(record))
    receiver.validate(outgoing)  # schema sees the payload, not the signature envelope
    assert msgpack.unpackb(receiver.strip_value(outgoing)) == {"step": 2, "loss": 0.1}
    bad = DHTRecord.create(key, {"step": "two", "loss": 0.1}, EXPIRES)
    bad = dataclasses.replace(bad, value=sender.sign_value(bad))
    with pytest.raises(ValidationError, match="violates the schema"):
        receiver.validate(bad)
    unsigned = DHTRecord.create(key, {"step": 2, "loss": 0.1}, EXPIRES)
    with pytest.raises(ValidationError, match="no signature"):
        receiver.validate(unsigned)
