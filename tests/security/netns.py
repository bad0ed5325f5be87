"""The set-up shared by the attack scenarios that need addresses of several networks: each scenario
is a script run in a network namespace of its own (`unshare --net`), so the addresses it puts on
that namespace's loopback exist only there and vanish with the process. The script prints one
JSON line of what happened; the test asserts on it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]


def namespaces_missing() -> str | None:
    """Why a private network namespace cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create a network namespace"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian packages util-linux and iproute2)"
    return None


def run_scenario(script: Path, timeout: float) -> dict[str, Any]:
    """Runs `script` in a new network namespace and returns its last line's JSON; skips the test
    where no namespace can be made."""
    missing = namespaces_missing()
    if missing:
        pytest.skip(missing)
    done = subprocess.run(
        ["unshare", "--net", sys.executable, str(script)], check=False, capture_output=True, text=True,
        timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_addresses(*hosts: str) -> None:
    """Inside the scenario's namespace: brings loopback up and gives it each of `hosts` (/32)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    for host in hosts:
        subprocess.run(["ip", "addr", "add", f"{host}/32", "dev", "lo"], check=True)
