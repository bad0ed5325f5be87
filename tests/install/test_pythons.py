"""swarm on every Python it declares (3.11, 3.12, 3.13): the suite's torch-free part
(tests/torch_free.py) runs under 3.12 and 3.13, in a venv of that interpreter without torch; and
on 3.13, the Python Colab runs, installing swarm next to Colab's packages (less torch) changes none.

The suite itself runs on 3.11 (scripts/test.sh's .venv). The interpreters are looked up under
pyenv and on PATH; where one is missing its test skips and says so. The venvs are kept in a cache
(~/.cache/swarm-tests, keyed by pyproject.toml, the constraints and the checkout's path), so a
rerun spends its time on the tests. Running the torch-free part takes minutes per interpreter
(BENCHMARKS.md, "Infrastructure nodes without torch"), so these run where SWARM_TEST_PYTHONS=1
(CI sets it) and skip elsewhere with that reason.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest
import torch_free
from install.test_colab_pins import PINS, colab_pins
from install.venvs import CONSTRAINTS, ROOT, Venv, interpreter, normalize, without_torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.environ.get("SWARM_TEST_PYTHONS") != "1",
                       reason="SWARM_TEST_PYTHONS=1 runs the torch-free suite under Python 3.12 and 3.13 "
                              "(minutes each; CI sets it)"),
]

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "swarm-tests"


def _cached_venv(version: str, purpose: str, *inputs: bytes) -> tuple[Venv, bool]:
    """A venv of Python `version` in the cache; True when it was made now (and needs its packages)."""
    python = interpreter(version)
    if python is None:
        pytest.skip(f"Python {version} is not installed here (not under pyenv, not on PATH)")
    checkout = hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]
    key = hashlib.sha256(b"\0".join([(ROOT / "pyproject.toml").read_bytes(), CONSTRAINTS.read_bytes(),
                                     *inputs])).hexdigest()[:16]
    path = CACHE / f"py{version}-{purpose}-{checkout}-{key}"
    ready = path / ".ready"
    for stale in CACHE.glob(f"py{version}-{purpose}-{checkout}-*"):  # this checkout's, for another pyproject.toml
        if stale != path:
            shutil.rmtree(stale, ignore_errors=True)
    venv = Venv(path, python=python, reuse=ready.is_file())
    return venv, not ready.is_file()


@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_the_torch_free_suite_passes_without_torch(version: str, tmp_path: Path) -> None:
    venv, fresh = _cached_venv(version, "torch-free")
    if fresh:  # the checkout, editable, with what the tests need; no torch
        constraints = without_torch(CONSTRAINTS, tmp_path / "constraints.txt")
        venv.pip("install", "-q", "-c", constraints, "-e", f"{ROOT}[test]", timeout=900)
        (venv.path / ".ready").touch()
    assert "torch" not in venv.versions(), "the torch-free venv holds torch"
    line = venv.python("-c", "import sys, swarm; print(sys.version_info[:2], swarm.__file__)").stdout
    assert f"({version.replace('.', ', ')})" in line and line.split()[-1].startswith(str(ROOT)), line
    result = venv.run([venv.bin("python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                       *torch_free.pytest_args()], timeout=1500, cwd=ROOT)
    summary = result.stdout.strip().splitlines()[-1]
    print(f"Python {version}, torch-free part: {summary}")
    assert re.search(r"\d+ passed", summary) and "failed" not in summary and "error" not in summary, summary


def test_on_colabs_python_swarm_installs_into_colab_pins_without_torch_and_changes_none(
        dists: tuple[Path, Path], tmp_path: Path) -> None:
    """The notebook needs torch; for Python 3.13 this machine has no torch wheel (only CUDA builds
    download), so here the install, `pip check` and a DHT through the installed package run on 3.13,
    and the notebook itself on 3.11 (tests/install/test_colab_pins.py)."""
    _, wheel = dists
    venv, fresh = _cached_venv("3.13", "colab", PINS.read_bytes())
    if fresh:
        venv.pip("install", "-q", "-r", PINS, timeout=900)
        (venv.path / ".ready").touch()
    else:
        venv.pip("uninstall", "-q", "-y", "swarm-peer", "base58")  # what the last run added
    before = venv.versions()
    pins = colab_pins()
    assert {name: before.get(name) for name in pins} == pins, "the venv holds Colab's versions"
    assert "torch" not in before and "swarm-peer" not in before
    venv.pip("install", "-q", wheel)
    after = venv.versions()
    changed = {name: (v, after.get(name)) for name, v in before.items() if after.get(name) != v}
    assert not changed, f"installing swarm changed Colab's packages (before, after): {changed}"
    assert "No broken requirements found" in venv.pip("check").stdout
    assert sorted(set(after) - set(before)) == sorted(normalize(n) for n in ("swarm-peer", "base58"))
    out = venv.python("-c", DHT_ROUND_TRIP, timeout=120, ).stdout
    assert out.strip().splitlines()[-1] == "stored and found, Python 3.13, no torch", out


DHT_ROUND_TRIP = """
import sys, time
import swarm
with swarm.Peer(listen="/ip4/127.0.0.1/tcp/0") as a, \\
        swarm.Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=a.addrs) as b:
    assert a.dht.store("k", 1, time.time() + 60)
    assert b.dht.get("k").value == 1
try:
    swarm.Optimizer
except swarm.MissingDependency as e:
    assert 'pip install "swarm-peer[torch]"' in str(e), e
print(f"stored and found, Python {sys.version_info[0]}.{sys.version_info[1]}, "
      + ("torch" if "torch" in sys.modules else "no torch"))
"""
