"""Peers behind NAT serve, in the network lab (real processes in real namespaces, docs/relay.md):
an expert server behind a home router is reached by a trainer on another host through relays,
and when its relay is SIGKILLed it comes back through another while the mixture skips it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from swarm.core.multiaddr import Multiaddr
from swarm.testing import HostSpec, Lab

PY = sys.executable
CLIENT = str(Path(__file__).with_name("nat_client.py"))
AVERAGER = str(Path(__file__).with_name("nat_averager.py"))
HIDDEN = 16


class Lines:
    """A process's stdout lines, read by a thread, taken with a timeout."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            self.queue.put(raw.decode(errors="replace").strip())
        self.queue.put(None)

    def next(self, timeout: float) -> str:
        line = self.queue.get(timeout=timeout)
        if line is None:
            raise AssertionError("the process exited")
        return line


def peer_process(lab: Lab, host: str, *extra: str) -> tuple[subprocess.Popen[bytes], list[str]]:
    """Starts `python -m swarm` on `host`; returns it and the addresses it printed when ready."""
    proc = lab.spawn(host, [PY, "-m", "swarm", "--listen", f"/ip4/{lab.address(host)}/tcp/0",
                            "--log-level", "WARNING", *extra])
    lines = Lines(proc)
    addrs = [lines.next(90)]
    while True:  # a peer prints every address at once; the next line would take a while
        try:
            addrs.append(lines.next(1.0))
        except queue.Empty:
            return proc, addrs


def test_an_expert_server_behind_nat_serves_a_trainer_and_survives_its_relay_killed(needs_lab) -> None:
    hosts = [HostSpec("r1"), HostSpec("r2"), HostSpec("pub"), HostSpec("t1"), HostSpec("home", nat=True)]
    with Lab(hosts) as lab:
        relays = {}
        first, first_addrs = peer_process(lab, "r1")
        relays[Multiaddr.parse(first_addrs[0]).peer_id] = first
        second, second_addrs = peer_process(lab, "r2", "--initial-peers", first_addrs[0])
        relays[Multiaddr.parse(second_addrs[0]).peer_id] = second
        _, pub_addrs = peer_process(lab, "pub", "--initial-peers", first_addrs[0], "--experts", "ffn.0.[0:2]",
                                    "--expert-cls", "ffn", "--hidden-dim", str(HIDDEN))
        _, home_addrs = peer_process(lab, "home", "--initial-peers", first_addrs[0], second_addrs[0],
                                     "--experts", "ffn.1.[0:2]", "--expert-cls", "ffn", "--hidden-dim", str(HIDDEN))
        relayed = [Multiaddr.parse(a) for a in home_addrs]
        # it found it is behind NAT by itself, and holds reservations on both relays it was given
        assert {a.relay_id for a in relayed} == set(relays), home_addrs
        client = lab.spawn("t1", [PY, CLIENT, pub_addrs[0], "ffn.1.0", "120", str(HIDDEN)])
        lines = Lines(client)
        ticks: list[dict] = []
        deadline = time.monotonic() + 60
        while not (ticks and ticks[-1]["expert"]):  # the trainer reaches the NAT'd expert through a relay
            assert time.monotonic() < deadline, ticks[-3:]
            ticks.append(json.loads(lines.next(30)))
        used = Multiaddr.parse(ticks[-1]["addr"]).relay_id
        assert used in relays
        os.killpg(relays[used].pid, signal.SIGKILL)
        killed_at = time.time()
        after: list[dict] = []
        deadline = time.monotonic() + 45
        while not (after and after[-1]["expert"]):
            assert time.monotonic() < deadline, after[-3:]
            after.append(json.loads(lines.next(30)))
        back = after[-1]
        assert Multiaddr.parse(back["addr"]).relay_id not in (None, used)  # through another relay
        # meanwhile the mixture went on with the experts it could reach: no tick without a forward
        assert all(t["mixture"] for t in ticks + after), [t for t in ticks + after if not t["mixture"]][:3]
        print(f"NAT'd expert reachable again {back['t'] - killed_at:.1f} s after its relay was killed")


def test_two_peers_behind_nat_and_two_public_ones_average_exactly_and_hand_over_state(needs_lab) -> None:
    hosts = [HostSpec("pub1"), HostSpec("pub2"), HostSpec("nat1", nat=True), HostSpec("nat2", nat=True),
             HostSpec("new", nat=True)]
    with Lab(hosts) as lab:
        procs, addrs = [], []
        for index, host in enumerate(("pub1", "pub2", "nat1", "nat2")):
            proc = lab.spawn(host, [PY, AVERAGER, "peer", lab.address(host), addrs[0] if addrs else "", str(index)],
                             stdin=subprocess.PIPE)
            lines = Lines(proc)
            ready = json.loads(lines.next(90))
            procs.append((proc, lines))
            addrs.append(ready["addr"])
            # the first peer has nobody to ask; the others find out, and the NAT'd ones go through relays
            assert ready["reachability"] == ("unknown" if index == 0 else "public" if index < 2 else "private")
            assert (Multiaddr.parse(ready["addr"]).relay_id is not None) == (index >= 2), ready
        for proc, _ in procs:
            assert proc.stdin is not None
            proc.stdin.write((json.dumps({"addrs": addrs}) + "\n").encode())
            proc.stdin.flush()
        results = [json.loads(lines.next(90)) for _, lines in procs]
        assert all(r["ok"] for r in results), results
        assert all(r["max_err"] <= 1e-5 for r in results), results
        assert len({tuple(r["contributors"]) for r in results}) == 1 and len(results[0]["contributors"]) == 4
        # a newcomer, itself behind NAT, downloads the state of a peer behind another NAT, through its relay
        done = lab.exec("new", [PY, AVERAGER, "newcomer", lab.address("new"), addrs[2]], timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        got = json.loads(done.stdout.strip().splitlines()[-1])
        assert got["equal"] and got["sources"] == [Multiaddr.parse(addrs[2]).peer_id]
        for proc, _ in procs:
            proc.stdin.write(b"stop\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]


PUNCH = str(Path(__file__).with_name("nat_punch.py"))


def _punch_case(lab: Lab, *caller_mode: str) -> tuple[dict, subprocess.Popen[bytes], Lines, subprocess.Popen[bytes]]:
    """A relay on a public host, a server on `home2`, a caller on `home1` (both behind NAT;
    `caller_mode` "client": the caller runs in client mode)."""
    relay, relay_addrs = peer_process(lab, "relay")
    server = lab.spawn("home2", [PY, PUNCH, "serve", lab.address("home2"), relay_addrs[0]], stdin=subprocess.PIPE)
    ready = json.loads(Lines(server).next(90))
    assert ready["reachability"] == "private" and Multiaddr.parse(ready["addr"]).relay_id, ready
    caller = lab.spawn("home1", [PY, PUNCH, "call", lab.address("home1"), relay_addrs[0], ready["addr"], *caller_mode],
                       stdin=subprocess.PIPE)
    lines = Lines(caller)
    result = json.loads(lines.next(120))
    print(json.dumps(result))
    return result, caller, lines, relay


def test_two_peers_behind_masquerade_nat_punch_a_hole_and_keep_talking_without_the_relay(needs_lab) -> None:
    hosts = [HostSpec("relay"), HostSpec("home1", nat=True), HostSpec("home2", nat=True)]
    with Lab(hosts) as lab:
        result, caller, lines, relay = _punch_case(lab)
        assert result["ok"] and result["state"], result
        # the call and the state's bulk stream both went over punched connections
        assert result["direct"] >= 2 and result["relayed"] == 0 and result["failed"] == 0, result
        os.killpg(relay.pid, signal.SIGKILL)  # the only relay: only a direct connection still works
        relay.wait(10)
        caller.stdin.write(b"again\n")  # type: ignore[union-attr]
        caller.stdin.flush()  # type: ignore[union-attr]
        assert json.loads(lines.next(30))["ok"]


def test_behind_a_random_port_nat_the_punch_fails_and_traffic_stays_relayed(needs_lab) -> None:
    hosts = [HostSpec("relay"), HostSpec("home1", nat=True, nat_type="random"), HostSpec("home2", nat=True)]
    with Lab(hosts) as lab:
        result, caller, _, _ = _punch_case(lab)
        assert result["ok"] and result["state"], result
        assert result["direct"] == 0 and result["failed"] == 1 and result["relayed"] >= 1, result
        caller.stdin.write(b"stop\n")  # type: ignore[union-attr]
        caller.stdin.flush()  # type: ignore[union-attr]


def test_a_client_mode_caller_behind_nat_punches_too(needs_lab) -> None:
    hosts = [HostSpec("relay"), HostSpec("home1", nat=True), HostSpec("home2", nat=True)]
    with Lab(hosts) as lab:
        result, caller, _, _ = _punch_case(lab, "client")
        assert result["reachability"] == "client" and result["my_ip"] == lab.public_address("home1"), result
        assert result["ok"] and result["state"], result
        assert result["direct"] >= 2 and result["relayed"] == 0 and result["failed"] == 0, result
        caller.stdin.write(b"stop\n")  # type: ignore[union-attr]
        caller.stdin.flush()  # type: ignore[union-attr]
