"""swarm on every Python it declares (3.11, 3.12, 3.13): the suite's torch-free part
(tests/torch_free.py) runs under 3.12 and 3.13, in a venv of that interpreter without torch; and
on 3.13, the Python Colab runs, installing swarm next to Colab's packages (less torch) changes none.

The suite itself runs on 3.11 (scripts/test.sh's .venv). The interpreters are looked up under
pyenv and on PATH; where one is missing its test skips and says so. The venvs are kept in
.venv/pythons/ (ignored by git, keyed by pyproject.toml and the constraints; a lock keeps two runs
from making one at once), so after the first run these tests spend their time on the tests. By
default they run the torch-free part less its long multi-node tests (`torch_free.LONG`; ~460
tests, on two xdist workers: mostly waiting on processes; BENCHMARKS.md, "Infrastructure nodes
without torch"); SWARM_TEST_PYTHONS=full runs all of it, SWARM_TEST_PYTHONS=0 none.
"""

from __future__ import annotations

import os
import re
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch_free
from install.test_colab_pins import PINS, colab_pins
from install.venvs import CONSTRAINTS, ROOT, Venv, cached_venv, interpreter, normalize, without_torch

MODE = os.environ.get("SWARM_TEST_PYTHONS", "quick")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(MODE == "0", reason="SWARM_TEST_PYTHONS=0 turns the Python 3.12 and 3.13 runs off"),
]


def _venv(version: str, purpose: str, *inputs: bytes) -> AbstractContextManager[tuple[Venv, bool]]:
    python = interpreter(version)
    if python is None:
        pytest.skip(f"Python {version} is not installed here (not under pyenv, not on PATH)")
    return cached_venv(python, f"py{version}-{purpose}", *inputs)


@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_the_torch_free_suite_passes_without_torch(version: str, tmp_path: Path) -> None:
    with _venv(version, "torch-free") as (venv, fresh):
        if fresh:  # the checkout, editable, with what the tests need; no torch
            constraints = without_torch(CONSTRAINTS, tmp_path / "constraints.txt")
            venv.pip("install", "-q", "-c", constraints, "-e", f"{ROOT}[test]", timeout=900)
    line = venv.python("-c", "import importlib.util as u, sys, swarm; "
                             "print(sys.version_info[:2], [n for n in ('torch', 'numpy') if u.find_spec(n)], "
                             "swarm.__file__)").stdout
    assert f"({version.replace('.', ', ')}) [] " in line, f"not Python {version}, or torch is there: {line}"
    assert line.split()[-1].startswith(str(ROOT)), line
    quick = MODE != "full"
    result = venv.run([venv.bin("python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                       tmp_path / "run", "-n", "2", *torch_free.pytest_args(quick=quick)],
                      timeout=1500, cwd=ROOT)
    summary = result.stdout.strip().splitlines()[-1]
    print(f"Python {version}, torch-free part{' less its long tests' if quick else ''}: {summary}")
    assert re.search(r"\d+ passed", summary) and "failed" not in summary and "error" not in summary, summary


def test_on_colabs_python_swarm_installs_into_colab_pins_without_torch_and_changes_none(
        dists: tuple[Path, Path], tmp_path: Path) -> None:
    """The notebook needs torch; for Python 3.13 this machine has no torch wheel (only CUDA builds
    download), so here the install, `pip check` and a DHT through the installed package run on 3.13,
    and the notebook itself on 3.11 (tests/install/test_colab_pins.py)."""
    _, wheel = dists
    with _venv("3.13", "colab", PINS.read_bytes()) as (venv, fresh):
        if fresh:
            venv.pip("install", "-q", "-r", PINS, timeout=900)
    venv.pip("uninstall", "-q", "-y", "swarm-peer", "base58")  # what a run before this one added
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
    out = venv.python("-c", DHT_ROUND_TRIP, timeout=120).stdout
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
