#!/usr/bin/env python
"""Writes docs/settings.md: every setting of swarm, with its default and what it does, read from
the configuration dataclasses themselves (each `*Config` class under swarm/, its fields'
defaults, and the "Attributes:" section of its docstring). tests/test_settings_doc.py checks that
the committed page is what this script writes, so a setting added or changed in code shows up
here in the same commit.

    .venv/bin/python scripts/gen_settings_doc.py [--check]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "settings.md"
_CLASS = re.compile(r"^class (\w+Config)\b", re.MULTILINE)

HEADER = """# Settings

Every setting swarm has, one table per component, generated from the code by
`scripts/gen_settings_doc.py` (do not edit by hand: `tests/test_settings_doc.py` fails when this
page and the code disagree). Each component takes one frozen configuration dataclass, validated
when it is built; the main ones are exported from `swarm` (`swarm.AveragerConfig`,
`swarm.CollaborationConfig`, ...), the others from the module named in each heading. The daemon's
flags (`swarm-peer --help`, docs/operations.md) set the most used of them.
"""


def config_classes() -> list[type]:
    """Every `*Config` dataclass defined under swarm/, in a stable order (module path, then line)."""
    found: list[type] = []
    for path in sorted((ROOT / "swarm").rglob("*.py")):
        names = _CLASS.findall(path.read_text())
        if not names:
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        loaded = importlib.import_module(module)
        for name in names:
            cls = getattr(loaded, name)
            if dataclasses.is_dataclass(cls):
                found.append(cls)
    return found


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> its description in the class docstring's "Attributes:" section (Google style)."""
    lines = (inspect.getdoc(cls) or "").splitlines()
    out: dict[str, str] = {}
    start = next((i + 1 for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
    if start is None:
        return out
    body = [line for line in lines[start:] if line.strip()]
    if not body:
        return out
    indent = len(body[0]) - len(body[0].lstrip())  # of the entries (0 where the docstring opens with the section)
    current = None
    for line in lines[start:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth < indent:
            break  # the next section
        match = re.match(r"^(\w+)(?: \([^)]*\))?: ?(.*)$", line[indent:]) if depth == indent else None
        if match:
            current = match.group(1)
            out[current] = match.group(2).strip()
        elif current is not None:
            out[current] += " " + line.strip()
    return out


def default_of(f: dataclasses.Field) -> str:  # type: ignore[type-arg]
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return f"`{type(value).__name__}()`"
    else:
        return "(required)"
    text = repr(value)
    if hasattr(value, "name") and type(value).__module__ != "builtins":  # an enum member
        text = f"{type(value).__name__}.{value.name}"
    return f"`{text}`"


def summary(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def render() -> str:
    parts = [HEADER]
    for cls in config_classes():
        docs = attribute_docs(cls)
        parts.append(f"\n## `{cls.__name__}` (`{cls.__module__}`)\n\n{summary(cls)}\n")
        parts.append("| setting | default | what it does |\n|---|---|---|")
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):
                continue
            text = docs.get(f.name, "").replace("|", "\\|")
            parts.append(f"| `{f.name}` | {default_of(f).replace('|', chr(92) + '|')} | {text} |")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/settings.md is not up to date")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print("docs/settings.md is out of date: run scripts/gen_settings_doc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
