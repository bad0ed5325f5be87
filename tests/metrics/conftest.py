"""Shared by the metrics tests: a strict parser of the Prometheus text exposition."""

import re

import pytest

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')


def parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Exposition text -> {(name, sorted labels): value}; fails on any malformed line."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith(("# HELP ", "# TYPE ")):
            continue
        m = SAMPLE.match(line)
        assert m, f"malformed sample line {line!r}"
        labels = tuple(sorted(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or "")))
        samples[(m.group(1), labels)] = float(m.group(4))
    return samples


@pytest.fixture
def parse():
    return parse_exposition
