"""docs/architecture.md's folder table lists every module: a module added to a package without its
row naming it (as `name.py`) fails here, and so does a package without a row."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| [^|]+ \| (?P<folders>[^|]+) \| (?P<holds>.+) \|$")


def folder_rows() -> dict[str, str]:
    """What each folder's row of the table says, keyed by the folder (`swarm/net`)."""
    rows: dict[str, str] = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        match = ROW.match(line)
        if match is None:
            continue
        for folder in re.findall(r"`(swarm/[^`]*)`", match.group("folders")):
            rows[folder.rstrip("/")] = match.group("holds")
    return rows


def test_every_module_of_every_package_is_in_its_folders_row() -> None:
    rows = folder_rows()
    missing = []
    for package in sorted(p.parent for p in (ROOT / "swarm").rglob("__init__.py")):
        folder = package.relative_to(ROOT).as_posix()
        if folder in ("swarm", "swarm/proto"):  # the top level has its own rows; proto is generated
            continue
        row = rows.get(folder)
        if row is None:
            missing.append(f"{folder}/ (no row)")
            continue
        missing += [f"{folder}/{m.name}" for m in sorted(package.glob("*.py"))
                    if m.name != "__init__.py" and f"`{m.name}`" not in row and f"`{m.stem}`" not in row]
    assert missing == [], f"modules docs/architecture.md's folder table does not name: {missing}"
