"""Commands the lab runs to build hosts: `ip`, `tc` and `iptables` inside named network namespaces,
and the cleaner that removes what a killed lab left behind.

Every lab names its namespaces `swlab-<pid>-<4 hex>-...` (the owner's pid and a random tag), so
parallel labs never collide and a namespace whose owner is gone is known to be stale.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

NETNS_DIR = Path("/run/netns")
PREFIX = "swlab"
_OWNED = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]{{4}}(-|$)")


class LabError(RuntimeError):
    """The lab could not build or change its network (a command failed, a tool is missing)."""


def missing_requirements() -> str | None:
    """Why the lab cannot run here (not root, a tool missing), or None when it can."""
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, tc, iptables)"
    for tool in ("ip", "tc", "iptables", "iptables-restore"):
        if shutil.which(tool) is None:
            return f"the network lab needs `{tool}` (Debian packages iproute2 and iptables)"
    return None


def new_prefix() -> str:
    """A namespace-name prefix unique to this lab: the owner pid and a random tag."""
    return f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"


def run(argv: Sequence[str], stdin: str | None = None, check: bool = True) -> str:
    """Runs a command; on failure raises LabError with what it printed."""
    try:
        done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LabError(f"{' '.join(argv)}: {e}") from e
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def ip_batch(namespace: str, commands: Sequence[str]) -> None:
    """Runs `ip` commands (one per line, without the leading `ip`) inside `namespace`."""
    if commands:
        run(["ip", "-n", namespace, "-batch", "-"], stdin="\n".join(commands) + "\n")


def tc(namespace: str, *args: str) -> None:
    run(["tc", "-n", namespace, *args])


def iptables_restore(namespace: str, rules: str) -> None:
    """Loads iptables tables into `namespace` (`--noflush`: the tables it does not name stay)."""
    run(["ip", "netns", "exec", namespace, "iptables-restore", "--noflush"], stdin=rules)


def iptables(namespace: str, *args: str) -> None:
    run(["ip", "netns", "exec", namespace, "iptables", "-w", "5", *args])


def sysctl(namespace: str, key: str, value: str) -> None:
    run(["ip", "netns", "exec", namespace, "sysctl", "-q", "-w", f"{key}={value}"])


def add_namespace(name: str) -> None:
    run(["ip", "netns", "add", name])


def namespace_pids(name: str) -> list[int]:
    out = run(["ip", "netns", "pids", name], check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def delete_namespace(name: str) -> None:
    """Kills every process still inside `name`, then removes the namespace (and its links)."""
    for pid in namespace_pids(name):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    run(["ip", "netns", "delete", name], check=False)


def lab_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the namespaces under /run/netns that start with `prefix`."""
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale() -> list[str]:
    """Removes the namespaces of labs whose owning process is gone (a run killed with SIGKILL);
    returns their names. Namespaces of labs still running are left alone."""
    removed = []
    for name in lab_namespaces():
        m = _OWNED.match(name)
        if m and not _alive(int(m.group(1))):
            delete_namespace(name)
            removed.append(name)
    return removed
