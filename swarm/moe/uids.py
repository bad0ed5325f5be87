"""Expert UIDs: names of experts on a grid, patterns that expand to many, and DHT prefixes.

An expert UID is a prefix followed by one or more grid coordinates, joined by
`UID_DELIMITER`: ``ffn.3.1`` is the expert at coordinates ``(3, 1)`` of grid ``ffn``.

- The prefix matches ``[A-Za-z_][A-Za-z0-9_-]*`` (one segment, no delimiter).
- Each coordinate is a non-negative decimal integer written canonically (``0``, ``7``,
  ``12``; never ``07`` or ``+7``), so one expert has exactly one UID string.

A server declares each expert in the DHT under every proper prefix of its UID
(`uid_prefixes`), so a client that wants live experts of grid ``ffn`` whose first
coordinate is 3 reads one key, ``ffn.3.``, instead of scanning the grid.
"""

from __future__ import annotations

import itertools
import math
import re

UID_DELIMITER = "."
"""Separates the prefix and the coordinates of an expert UID."""

MAX_EXPANSION = 100_000
"""The most UIDs `expand_pattern` produces by default."""

_PREFIX_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_COORD_RE = re.compile(r"0|[1-9][0-9]*")
_RANGE_RE = re.compile(r"\[\s*(0|[1-9][0-9]*)?\s*:\s*(0|[1-9][0-9]*)\s*\]")


def parse_uid(uid: str) -> tuple[str, tuple[int, ...]]:
    """Splits an expert UID into its prefix and grid coordinates.

    Args:
        uid: an expert UID such as ``"ffn.3.1"``.

    Returns:
        ``(prefix, coords)``, e.g. ``("ffn", (3, 1))``.

    Raises:
        TypeError: `uid` is not a string.
        ValueError: `uid` is not a valid expert UID; the message says which part is wrong.
    """
    if not isinstance(uid, str):
        raise TypeError(f"expert uid must be a str, got {type(uid).__name__}")
    prefix, *coords = uid.split(UID_DELIMITER)
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"invalid expert uid {uid!r}: prefix {prefix!r} must match [A-Za-z_][A-Za-z0-9_-]*")
    if not coords:
        raise ValueError(f"invalid expert uid {uid!r}: expected at least one coordinate, e.g. {prefix}.0")
    for coord in coords:
        if not _COORD_RE.fullmatch(coord):
            raise ValueError(
                f"invalid expert uid {uid!r}: coordinate {coord!r} is not a non-negative integer "
                f"written without sign or leading zeros"
            )
    return prefix, tuple(int(c) for c in coords)


def is_valid_uid(uid: str) -> bool:
    """Tells whether `uid` is a valid expert UID (see `parse_uid`)."""
    try:
        parse_uid(uid)
    except (TypeError, ValueError):
        return False
    return True


def format_uid(prefix: str, coords: tuple[int, ...] | list[int]) -> str:
    """Builds the UID of the expert at `coords` on grid `prefix`.

    Args:
        prefix: the grid's prefix, e.g. ``"ffn"`` (without a trailing delimiter).
        coords: one or more non-negative coordinates.

    Returns:
        The canonical UID, e.g. ``format_uid("ffn", (3, 1)) == "ffn.3.1"``.

    Raises:
        ValueError: the prefix or a coordinate is invalid.
    """
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in coords):
        raise ValueError(f"coordinates must be non-negative integers, got {tuple(coords)!r}")
    uid = UID_DELIMITER.join([prefix, *map(str, coords)])
    parse_uid(uid)
    return uid


def uid_prefixes(uid: str) -> list[str]:
    """Lists the DHT prefixes under which a server declares the expert `uid`.

    For a UID ``p.c1.c2...cd`` with ``d`` coordinates this returns the ``d`` proper prefixes
    that end with the delimiter, shortest first:
    ``["p.", "p.c1.", ..., "p.c1...c(d-1)."]``. The UID itself is not included (the expert is
    declared under its own UID separately). Example: ``uid_prefixes("ffn.3.1") ==
    ["ffn.", "ffn.3."]``.

    Args:
        uid: a valid expert UID.

    Returns:
        The prefixes, shortest first.

    Raises:
        ValueError: `uid` is not a valid expert UID.
    """
    prefix, coords = parse_uid(uid)
    out = []
    head = prefix + UID_DELIMITER
    for coord in coords[:-1]:
        out.append(head)
        head = f"{head}{coord}{UID_DELIMITER}"
    out.append(head)
    return out


def is_valid_prefix(prefix: str) -> bool:
    """Tells whether `prefix` is a grid prefix as `uid_prefixes` produces (e.g. ``"ffn.3."``)."""
    if not isinstance(prefix, str) or not prefix.endswith(UID_DELIMITER):
        return False
    head, *coords = prefix[: -len(UID_DELIMITER)].split(UID_DELIMITER)
    return bool(_PREFIX_RE.fullmatch(head)) and all(_COORD_RE.fullmatch(c) for c in coords)


def expand_pattern(pattern: str, max_experts: int = MAX_EXPANSION) -> list[str]:
    """Expands a grid pattern into the expert UIDs it names.

    Each coordinate of the pattern is either a single integer or a half-open range
    ``[a:b]`` (``a`` defaults to 0), so ``"ffn.[0:4].[0:4]"`` names 16 experts
    ``ffn.0.0``, ``ffn.0.1``, ..., ``ffn.3.3`` and ``"ffn.[0:4].2"`` names 4. UIDs come in
    lexicographic order of their coordinates. A plain UID expands to itself.

    Args:
        pattern: the pattern, e.g. ``"ffn.[0:4].[0:4]"``.
        max_experts: refuse patterns naming more experts than this.

    Returns:
        The UIDs, in order, without duplicates.

    Raises:
        TypeError: `pattern` is not a string.
        ValueError: the pattern is malformed, has an empty range, or names more than
            `max_experts` experts.
    """
    if not isinstance(pattern, str):
        raise TypeError(f"expert pattern must be a str, got {type(pattern).__name__}")
    prefix, *parts = pattern.split(UID_DELIMITER)
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(
            f"invalid expert pattern {pattern!r}: prefix {prefix!r} must match [A-Za-z_][A-Za-z0-9_-]*"
        )
    if not parts:
        raise ValueError(
            f"invalid expert pattern {pattern!r}: expected at least one coordinate, e.g. {prefix}.[0:4]"
        )
    axes: list[range] = []
    for part in parts:
        if _COORD_RE.fullmatch(part):
            axes.append(range(int(part), int(part) + 1))
            continue
        match = _RANGE_RE.fullmatch(part)
        if match is None:
            raise ValueError(
                f"invalid expert pattern {pattern!r}: coordinate {part!r} must be an integer "
                f"or a half-open range [a:b]"
            )
        start, stop = int(match.group(1) or 0), int(match.group(2))
        if start >= stop:
            raise ValueError(f"invalid expert pattern {pattern!r}: range {part!r} is empty")
        axes.append(range(start, stop))
    total = math.prod(len(axis) for axis in axes)
    if total > max_experts:
        raise ValueError(
            f"expert pattern {pattern!r} names {total} experts, more than the limit of {max_experts}"
        )
    return [UID_DELIMITER.join([prefix, *map(str, coords)]) for coords in itertools.product(*axes)]


Successors = dict[int, tuple[str, str]]
"""Live successors of one prefix: next coordinate -> (a UID under it, that expert's address)."""


def successor_coord(prefix: str, uid: str) -> int | None:
    """The coordinate that follows `prefix` in `uid`, or None if `uid` is not under `prefix`."""
    try:
        _, coords = parse_uid(uid)
        prefixes = uid_prefixes(uid)
    except (TypeError, ValueError):
        return None
    if prefix not in prefixes:
        return None
    return coords[prefix.count(UID_DELIMITER) - 1]
