"""Fresh virtual environments and swarm's own wheel, for the install tests.

`build_dists` runs `python -m build` on a copy of the checkout (the build's own isolated
environment fetches setuptools from the package index). `Venv` is a venv made with this
interpreter's `venv` module; pip in it sees the same indexes and find-links as the caller (this
machine's CPU torch wheel lies in PIP_FIND_LINKS) and installs without byte-compiling.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"
CACHE = ROOT / ".venv" / "pythons"
"""Venvs kept between runs (ignored by git; scripts/test.sh's .venv holds them)."""
TORCH = next(line for line in CONSTRAINTS.read_text().splitlines() if line.startswith("torch=="))
_IGNORE = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache",
                                 "build", "dist", "demo-out", "*.whl")


def run(argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Runs `argv`, raising with its output's tail when it fails."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def build_dists(tmp: Path) -> tuple[Path, Path]:
    """The sdist and the wheel `python -m build` makes from a copy of the checkout."""
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=_IGNORE)
    out = tmp / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(out), str(source)], timeout=600)
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


class Venv:
    """A new venv at `path` (of `python`, default this interpreter); `pip(...)`, `python(...)` and
    `bin(name)` run inside it. `reuse`: keep a venv already at `path` (a cache the caller keys)."""

    def __init__(self, path: Path, python: str | Path = sys.executable, reuse: bool = False) -> None:
        self.path = path
        if not (reuse and (path / "bin" / "python").is_file()):
            run([str(python), "-m", "venv", "--clear", str(path)], timeout=120)
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        self.env["PATH"] = f"{path / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
        # pip byte-compiles every file it installs (torch alone: ~45 s of a 2-core machine's CPU);
        # these venvs import a small part of what they hold, and Python compiles that on first import
        self.env["PIP_NO_COMPILE"] = "1"

    def bin(self, name: str) -> Path:
        return self.path / "bin" / name

    def run(self, argv: list[str | Path], timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return run([str(a) for a in argv], timeout=timeout, env=self.env, cwd=cwd or self.path)

    def pip(self, *args: str | Path, timeout: float = 900) -> subprocess.CompletedProcess:
        return self.run([self.bin("python"), "-m", "pip", "--disable-pip-version-check", *args], timeout=timeout)

    def python(self, *args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run([self.bin("python"), *args], timeout=timeout)

    def versions(self) -> dict[str, str]:
        """Installed distributions and their versions (names normalized as pip compares them)."""
        lines = self.pip("list", "--format=freeze", timeout=120).stdout.splitlines()
        return {normalize(n): v for n, _, v in (line.partition("==") for line in lines if "==" in line)}


def interpreter(version: str) -> Path | None:
    """A working `python<version>`: under pyenv (~/.pyenv/versions/<version>.*) or on PATH, or None."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = sorted(pyenv.glob(f"{version}.*/bin/python{version}"), key=lambda p: p.as_posix())
    found = shutil.which(f"python{version}")
    for candidate in [*reversed(candidates), *([Path(found)] if found else [])]:
        probe = subprocess.run([str(candidate), "-c", "import venv, sys; print(sys.version_info[:2])"],
                               capture_output=True, text=True, timeout=60, check=False)
        if probe.returncode == 0:  # a pyenv shim for a version not selected here fails
            return candidate
    return None


def without_torch(constraints: Path, out: Path) -> Path:
    """A copy of `constraints` less its torch line (a venv that must not get torch)."""
    out.write_text("".join(line + "\n" for line in constraints.read_text().splitlines()
                           if not line.startswith("torch")))
    return out


def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


@contextmanager
def cached_venv(python: str | Path, name: str, *inputs: bytes) -> Iterator[tuple[Venv, bool]]:
    """A venv of `python` kept in `CACHE` as `name`, held under a lock, and whether it was made now:
    then the caller installs its packages, and it is marked ready once the caller's block returns
    (a failed install leaves it to be made again). It is made again when pyproject.toml, the
    constraints or `inputs` change."""
    key = hashlib.sha256(b"\0".join([(ROOT / "pyproject.toml").read_bytes(), CONSTRAINTS.read_bytes(),
                                     *inputs])).hexdigest()[:16]
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"{name}-{key}"
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run, or another xdist worker, making the same one
        for stale in CACHE.glob(f"{name}-*"):
            if stale != path and stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        ready = path / ".ready"
        fresh = not ready.is_file()
        venv = Venv(path, python=python, reuse=not fresh)
        yield venv, fresh
        ready.touch()
