"""Tests of swarm.moe.uids: parsing, pattern expansion and DHT prefixes."""

from __future__ import annotations

import pytest

from swarm.moe.uids import (
    UID_DELIMITER,
    expand_pattern,
    format_uid,
    is_valid_prefix,
    is_valid_uid,
    parse_uid,
    uid_prefixes,
)


def test_delimiter() -> None:
    assert UID_DELIMITER == "."


@pytest.mark.parametrize(
    ("uid", "expected"),
    [
        ("ffn.3.1", ("ffn", (3, 1))),
        ("ffn.0", ("ffn", (0,))),
        ("expert_v2-big.10.0.7", ("expert_v2-big", (10, 0, 7))),
        ("_x.123456", ("_x", (123456,))),
    ],
)
def test_parse_uid(uid: str, expected: tuple[str, tuple[int, ...]]) -> None:
    assert parse_uid(uid) == expected
    assert is_valid_uid(uid)
    assert format_uid(*expected) == uid


@pytest.mark.parametrize(
    ("uid", "fragment"),
    [
        ("ffn", "at least one coordinate"),
        ("", "prefix"),
        (".3.1", "prefix"),
        ("3.1", "prefix"),
        ("ffn.3.", "coordinate ''"),
        ("ffn..1", "coordinate ''"),
        ("ffn.-1", "coordinate '-1'"),
        ("ffn.01", "leading zeros"),
        ("ffn.+1", "coordinate '+1'"),
        ("ffn.a", "coordinate 'a'"),
        ("ffn.[0:4]", "coordinate '[0:4]'"),
        ("ffn 1.2", "prefix"),
    ],
)
def test_parse_uid_rejects(uid: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="invalid expert uid") as info:
        parse_uid(uid)
    assert fragment in str(info.value)
    assert not is_valid_uid(uid)


def test_parse_uid_type() -> None:
    with pytest.raises(TypeError):
        parse_uid(3)  # type: ignore[arg-type]
    assert not is_valid_uid(None)  # type: ignore[arg-type]


def test_format_uid_rejects() -> None:
    with pytest.raises(ValueError):
        format_uid("ffn", (-1,))
    with pytest.raises(ValueError):
        format_uid("ffn", ())
    with pytest.raises(ValueError):
        format_uid("f.f", (1,))


def test_expand_grid() -> None:
    uids = expand_pattern("ffn.[0:4].[0:4]")
    assert len(uids) == 16
    assert uids[0] == "ffn.0.0" and uids[1] == "ffn.0.1" and uids[-1] == "ffn.3.3"
    assert uids == sorted(uids, key=lambda u: parse_uid(u)[1])
    assert len(set(uids)) == 16


def test_expand_single_int_and_half_open() -> None:
    assert expand_pattern("ffn.[0:4].2") == ["ffn.0.2", "ffn.1.2", "ffn.2.2", "ffn.3.2"]
    assert expand_pattern("ffn.[2:4]") == ["ffn.2", "ffn.3"]
    assert expand_pattern("ffn.[:2].[ 5 : 6 ]") == ["ffn.0.5", "ffn.1.5"]
    assert expand_pattern("ffn.3.1") == ["ffn.3.1"]


@pytest.mark.parametrize(
    ("pattern", "fragment"),
    [
        ("ffn.[3:3]", "empty"),
        ("ffn.[4:2]", "empty"),
        ("ffn", "at least one coordinate"),
        ("ffn.[0:4", "half-open range"),
        ("ffn.[a:4]", "half-open range"),
        ("ffn.[0:4:2]", "half-open range"),
        ("ffn.[-1:4]", "half-open range"),
        ("ffn.", "half-open range"),
        ("[0:4].1", "prefix"),
    ],
)
def test_expand_rejects(pattern: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="pattern") as info:
        expand_pattern(pattern)
    assert fragment in str(info.value)


def test_expand_rejects_huge_without_materializing() -> None:
    with pytest.raises(ValueError, match=r"names 10000000000 experts, more than the limit of 100000"):
        expand_pattern("ffn.[0:100000].[0:100000]")
    assert len(expand_pattern("ffn.[0:100000]")) == 100_000
    with pytest.raises(ValueError, match="limit of 8"):
        expand_pattern("ffn.[0:3].[0:3]", max_experts=8)


def test_uid_prefixes() -> None:
    assert uid_prefixes("ffn.3.1") == ["ffn.", "ffn.3."]
    assert uid_prefixes("ffn.3") == ["ffn."]
    assert uid_prefixes("a.1.2.3") == ["a.", "a.1.", "a.1.2."]
    for prefix in uid_prefixes("ffn.3.1.4"):
        assert is_valid_prefix(prefix)
        assert "ffn.3.1.4".startswith(prefix)
    with pytest.raises(ValueError):
        uid_prefixes("ffn")


def test_is_valid_prefix() -> None:
    assert is_valid_prefix("ffn.")
    assert is_valid_prefix("ffn.3.")
    assert not is_valid_prefix("ffn")
    assert not is_valid_prefix("ffn.3")
    assert not is_valid_prefix("ffn..")
    assert not is_valid_prefix(".")
    assert not is_valid_prefix("ffn.03.")
