"""Does a simultaneous TCP open (DCUtR's idea) get through the lab's NATs? (docs/relay.md)

For each pair of host kinds (public, behind a port-keeping MASQUERADE, behind `--random-fully`),
a lab with an observer and the two hosts: each side connects from a fixed local port to the
observer, which tells it the address and port it saw (as a relay would), then both sides,
started at the same moment (the coordination DCUtR does over the relayed connection; here the
harness's clock), connect from that same local port to the other's observed address, retrying
for a few seconds. A case succeeds when both ends hold one connection and exchange a message.

    sudo .venv/bin/python scripts/bench/lab_holepunch.py

Needs root (the lab). Prints a markdown table.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time

PORT = 40001
OBSERVER_PORT = 9000


def observe(host: str) -> None:
    server = socket.create_server((host, OBSERVER_PORT))
    print("ready", flush=True)
    while True:
        conn, peer = server.accept()
        conn.sendall(f"{peer[0]}:{peer[1]}\n".encode())
        conn.close()


def _bound() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("0.0.0.0", PORT))
    return sock


def side(observer: str) -> None:
    probe = _bound()
    probe.settimeout(5)
    probe.connect((observer, OBSERVER_PORT))
    observed = probe.makefile().readline().strip()
    print(json.dumps({"observed": observed}), flush=True)
    order = json.loads(sys.stdin.readline())
    host, port = order["peer"].rsplit(":", 1)
    time.sleep(max(0.0, order["start"] - time.time()))
    result = {"ok": False, "error": "", "attempts": 0}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not result["ok"]:
        result["attempts"] += 1
        sock = _bound()
        sock.settimeout(0.5)
        try:
            sock.connect((host, int(port)))
            sock.sendall(b"hello\n")
            ready, _, _ = select.select([sock], [], [], 2)
            result["ok"] = bool(ready) and sock.recv(16).startswith(b"hello")
        except OSError as e:
            result["error"] = f"{type(e).__name__}: {e}"
            time.sleep(0.05)  # the pace of retries, as a puncher would
        finally:
            sock.close()
    print(json.dumps(result), flush=True)


CASES = [("public", "masquerade"), ("masquerade", "masquerade"), ("public", "random"),
         ("masquerade", "random"), ("random", "random")]


def main() -> None:
    import subprocess

    from swarm.testing import HostSpec, Lab, LinkProfile

    link = LinkProfile(delay_ms=5)
    rows = []
    for kind_a, kind_b in CASES:
        specs = [HostSpec("obs", link)]
        for name, kind in (("a", kind_a), ("b", kind_b)):
            specs.append(HostSpec(name, link, nat=kind != "public",
                                  nat_type=kind if kind != "public" else "masquerade"))
        with Lab(specs, seed=1) as lab:
            obs = lab.spawn("obs", [sys.executable, __file__, "observe", lab.address("obs")])
            assert obs.stdout is not None
            obs.stdout.readline()
            sides = {n: lab.spawn(n, [sys.executable, __file__, "side", lab.address("obs")], stdin=subprocess.PIPE)
                     for n in ("a", "b")}
            observed = {n: json.loads(p.stdout.readline())["observed"] for n, p in sides.items()}  # type: ignore[union-attr]
            start = time.time() + 1.0
            for n, p in sides.items():
                other = "b" if n == "a" else "a"
                p.stdin.write(json.dumps({"peer": observed[other], "start": start}).encode() + b"\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            results = {n: json.loads(p.stdout.readline()) for n, p in sides.items()}  # type: ignore[union-attr]
        ok = results["a"]["ok"] and results["b"]["ok"]
        rows.append((kind_a, kind_b, observed, ok, results))
    print("| side A | side B | observed (A, B) | simultaneous open |")
    print("|---|---|---|---|")
    for kind_a, kind_b, observed, ok, results in rows:
        why = "" if ok else f" ({results['a']['error'] or results['b']['error']})"
        print(f"| {kind_a} | {kind_b} | {observed['a']}, {observed['b']} | {'yes' if ok else 'no'}{why} |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "observe":
        observe(sys.argv[2])
    elif len(sys.argv) > 2 and sys.argv[1] == "side":
        side(sys.argv[2])
    else:
        main()
