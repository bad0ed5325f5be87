"""The infrastructure install: swarm's wheel in a clean venv without torch (`pip install swarm-peer`)
gives a `swarm-peer` that serves as a DHT bootstrap node and a relay, and `swarm-peer status`.

Away from the checkout, with the dependencies from the package index. The same checks in a process
where torch is blocked rather than absent: tests/test_torch_free.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from install.venvs import CONSTRAINTS, Venv, without_torch
from procs import PeerProcess
from test_torch_free import CLIENT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_wheel_without_torch_runs_a_bootstrap_and_relay_node(dists: tuple[Path, Path], tmp_path: Path) -> None:
    _, wheel = dists
    venv = Venv(tmp_path / "venv")
    venv.pip("install", "-q", "-c", without_torch(CONSTRAINTS, tmp_path / "constraints.txt"), wheel)
    installed = venv.versions()
    assert "swarm-peer" in installed and not {"torch", "numpy"} & set(installed), sorted(installed)
    work = tmp_path / "work"  # not the checkout: what runs comes from the venv
    work.mkdir()
    env = {**venv.env, "PYTHONUNBUFFERED": "1"}
    python = str(venv.bin("python"))
    args = ["--listen", "/ip4/127.0.0.1/tcp/0", "--relay", "on", "--reachability", "public",
            "--identity", str(work / "node.key"), "--log-level", "WARNING"]
    with PeerProcess(*args, env=env, cwd=str(work), python=python, ready_timeout=60) as node:
        client = venv.run([python, "-c", CLIENT, node.addrs[0]], timeout=120, cwd=work)
        assert json.loads(client.stdout.splitlines()[-1]) == {"value": "through the node", "torch": False}
        status = venv.run([venv.bin("swarm-peer"), "status", "--initial-peers", node.addrs[0], "--json"],
                          timeout=60, cwd=work)
        assert json.loads(status.stdout)
        assert node.stop() == 0
    where = venv.python("-c", "import swarm; print(swarm.__file__)", timeout=60).stdout
    assert where.startswith(str(venv.path)), where
    needs = venv.python("-c", "import swarm\ntry:\n    swarm.ExpertServer\nexcept swarm.MissingDependency as e:\n"
                              "    print(e)", timeout=60).stdout
    assert 'swarm.ExpertServer needs torch' in needs and 'pip install "swarm-peer[torch]"' in needs, needs
