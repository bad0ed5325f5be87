"""An infrastructure node without torch holds a swarm together in the network lab: `swarm-peer`
from a venv that has neither torch nor numpy (`pip install swarm-peer`, the checkout installed
without extras) is the bootstrap node and the relay, on a public host of its own; two trainers with
torch, one public and one behind NAT, join through it, the NAT'd one reachable only through its
relay, and average exactly (tests/testing/nat_averager.py, real processes in real namespaces)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from install.venvs import CONSTRAINTS, ROOT, cached_venv, without_torch
from testing.test_nat_relay import AVERAGER, PY, Lines

from swarm.core.multiaddr import Multiaddr
from swarm.testing import HostSpec, Lab

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_torch_free_node_is_the_bootstrap_and_relay_of_trainers_one_behind_nat(needs_lab, tmp_path: Path) -> None:
    with cached_venv(sys.executable, "infra-node") as (venv, fresh):
        if fresh:  # the checkout, editable, without extras: what a VPS gets from `pip install swarm-peer`
            venv.pip("install", "-q", "-c", without_torch(CONSTRAINTS, tmp_path / "constraints.txt"), "-e", ROOT)
    missing = venv.python("-c", "import importlib.util as u; print([n for n in ('torch', 'numpy') if u.find_spec(n)])")
    assert missing.stdout.strip() == "[]", missing.stdout

    hosts = [HostSpec("infra"), HostSpec("pub"), HostSpec("home", nat=True)]
    with Lab(hosts) as lab:
        node = lab.spawn("infra", [str(venv.bin("swarm-peer")), "--listen", f"/ip4/{lab.address('infra')}/tcp/0",
                                   "--relay", "on", "--reachability", "public", "--log-level", "WARNING",
                                   "--identity", str(tmp_path / "infra.key")],
                         env={**venv.env, "PYTHONUNBUFFERED": "1"}, cwd=str(tmp_path))
        infra_addr = Lines(node).next(90)
        infra_id = Multiaddr.parse(infra_addr).peer_id
        trainers, addrs = [], []
        for index, host in enumerate(("pub", "home")):
            proc = lab.spawn(host, [PY, AVERAGER, "peer", lab.address(host), infra_addr, str(index)],
                             stdin=subprocess.PIPE)
            lines = Lines(proc)
            ready = json.loads(lines.next(90))
            trainers.append((proc, lines))
            addrs.append(ready["addr"])
            # the infrastructure node told each whether it is reachable; the NAT'd one took a reservation on it
            assert ready["reachability"] == ("public", "private")[index], ready
            assert Multiaddr.parse(ready["addr"]).relay_id == (None, infra_id)[index], ready
        for proc, _ in trainers:
            assert proc.stdin is not None
            proc.stdin.write((json.dumps({"addrs": addrs}) + "\n").encode())
            proc.stdin.flush()
        results = [json.loads(lines.next(120)) for _, lines in trainers]
        assert all(r["ok"] for r in results), results
        assert all(r["max_err"] <= 1e-5 for r in results), results
        assert all(len(r["contributors"]) == 2 for r in results), results
        for proc, _ in trainers:
            proc.stdin.write(b"stop\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        assert node.poll() is None, "the infrastructure node exited"
