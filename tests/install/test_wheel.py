"""swarm's sdist and wheel: `python -m build` makes them, `twine check` accepts them, and the wheel
installed into a clean venv (its dependencies from the package index, torch pinned to this
machine's CPU wheel) gives the `swarm-peer` command and runs the demo, away from the checkout.
"""

from __future__ import annotations

import re
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from install.venvs import ROOT, TORCH, Venv, run

import swarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def test_build_makes_an_sdist_and_a_wheel_named_swarm_peer_that_twine_accepts(dists: tuple[Path, Path]) -> None:
    pytest.importorskip("twine", reason="the dev extra's `twine` checks the distributions")
    sdist, wheel = dists
    version = swarm.__version__
    assert sdist.name == f"swarm_peer-{version}.tar.gz"
    assert wheel.name == f"swarm_peer-{version}-py3-none-any.whl"
    checked = run([sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)], timeout=120)
    assert checked.stdout.count("PASSED") == 2, checked.stdout
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(f"swarm_peer-{version}.dist-info/METADATA").decode()
        entry_points = z.read(f"swarm_peer-{version}.dist-info/entry_points.txt").decode()
    assert re.search(r"^Name: swarm-peer$", metadata, re.MULTILINE) and f"\nVersion: {version}\n" in metadata
    assert "swarm-peer = swarm.cli.peer:main" in entry_points
    # the import package is swarm, with its generated protobuf code and data files
    assert {"swarm/__init__.py", "swarm/py.typed", "swarm/proto/dht_pb2.py"} <= names
    # the dashboard's page and the charting library it serves, with that library's license
    assert {f"swarm/dashboard/static/{f}" for f in ("index.html", "app.js", "style.css", "vendor/uplot/LICENSE",
                                                     "vendor/uplot/uPlot.iife.min.js")} <= names
    committed = {p.relative_to(ROOT).as_posix() for p in (ROOT / "swarm").rglob("*.py")}
    assert committed <= names, sorted(committed - names)
    assert not [n for n in names if n.startswith(("tests/", "scripts/"))]
    with tarfile.open(sdist) as t:
        assert f"swarm_peer-{version}/pyproject.toml" in t.getnames()


def test_the_wheel_in_a_clean_venv_runs_swarm_peer_and_the_demo(dists: tuple[Path, Path], tmp_path: Path) -> None:
    _, wheel = dists
    venv = Venv(tmp_path / "venv")
    venv.pip("install", "-q", TORCH, f"{wheel}[demo]")
    work = tmp_path / "work"  # not the checkout: whatever runs here comes from the installed wheel
    work.mkdir()
    where = venv.python("-c", "import swarm; print(swarm.__file__, swarm.__version__)").stdout.split()
    assert where[0].startswith(str(venv.path)) and where[1] == swarm.__version__, where
    peer_help = venv.run([venv.bin("swarm-peer"), "--help"], cwd=work).stdout
    assert "--initial-peers" in peer_help and "--listen" in peer_help, peer_help
    status_help = venv.run([venv.bin("swarm-peer"), "status", "--help"], cwd=work).stdout
    assert "usage:" in status_help and "status" in status_help, status_help
    venv.run([venv.bin("python"), "-m", "pip", "check"])
    # the demo, short: an expert server and two trainers on loopback, from the installed package
    demo = venv.run([venv.bin("python"), "-m", "swarm.demo", "--duration", "15", "--trainers", "2",
                     "--out-dir", work / "out"], timeout=300, cwd=work)
    summary = demo.stdout + demo.stderr
    held_out = re.search(r"held-out loss\s+([\d.]+)\s*->\s*([\d.]+)", summary)
    assert held_out, summary[-3000:]
    assert (work / "out" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", summary[-3000:]
