#!/usr/bin/env python
"""Counts the lines of swarm/ whose code names `typing.Any`: comments, strings and import statements
left out, generated `*_pb2` modules too. One line per file with `-v`, most first.

    .venv/bin/python scripts/count_any.py [-v] [FOLDER]
"""

from __future__ import annotations

import io
import sys
import tokenize
from pathlib import Path


def any_lines(source: str) -> set[int]:
    """The line numbers where the name `Any` appears in code, not in an import statement."""
    lines: set[int] = set()
    in_import = False
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and token.string in ("import", "from") and token.line.lstrip().startswith(token.string):
            in_import = True
        elif token.type == tokenize.NEWLINE:
            in_import = False
        elif token.type == tokenize.NAME and token.string == "Any" and not in_import:
            lines.add(token.start[0])
    return lines


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "-v"]
    root = Path(args[0] if args else Path(__file__).resolve().parents[1] / "swarm")
    counts = {str(p): len(any_lines(p.read_text())) for p in sorted(root.rglob("*.py")) if "_pb2" not in p.name}
    counts = {path: n for path, n in counts.items() if n}
    print(f"{sum(counts.values())} lines name Any in {len(counts)} files under {root}")
    if "-v" in sys.argv:
        for path, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"{n:4d} {path}")


if __name__ == "__main__":
    main()
