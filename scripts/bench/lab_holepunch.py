"""Does a simultaneous TCP open (DCUtR's idea) get through the lab's NATs? (docs/relay.md)

For each pair of host kinds (public, behind a port-keeping MASQUERADE, behind `--random-fully`),
a lab with an observer and the two hosts: each side connects from a fixed local port to the
observer, which tells it the address and port it saw (as a relay would), then both sides,
started at the same moment (the coordination DCUtR does over the relayed connection; here the
harness's clock), connect from that same local port to the other's observed address, retrying
for a few seconds. A case succeeds when both ends hold one connection and exchange a message.

    sudo .venv/bin/python scripts/bench/lab_holepunch.py            # raw sockets, as above
    sudo .venv/bin/python scripts/bench/lab_holepunch.py --swarm    # swarm's own upgrade (holepunch.py)

With --swarm, each case runs a relay on a public host, a swarm peer behind side B's NAT and one on
side A that calls it (a unary call and a state download over the bulk side channel), and says
whether the connections were punched or went through the relay (docs/relay.md, "Hole punching"),
how long the caller's start took (its DHT join already dials the callee), what a fresh connection
costs (a new punch, or a failed one and the circuit: what a first call waits for before TLS) and
the median round trip of 100 calls on the path taken (5 ms each way on every link).

Needs root (the lab). Prints a markdown table.
"""

from __future__ import annotations

import json
import select
import socket
import statistics
import sys
import time

PORT = 40001
RTT_CALLS = 100  # Info calls whose median round trip is reported, after the first
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


def swarm_serve(host: str, initial: str) -> None:
    import torch

    from swarm.averaging import State, StateServer
    from swarm.peer import Peer

    me = Peer(initial_peers=[initial], listen=f"/ip4/{host}/tcp/0")
    StateServer(me, "lab", lambda: State({}, [torch.arange(200_000, dtype=torch.float32)]), chunk_bytes=1 << 16)
    print(json.dumps({"addr": me.addrs[0]}), flush=True)
    sys.stdin.readline()
    me.shutdown()


def swarm_call(host: str, initial: str, target: str) -> None:
    from swarm.averaging import load_state_from_peers
    from swarm.core.multiaddr import Multiaddr
    from swarm.net import holepunch, relay
    from swarm.peer import Peer

    started = time.monotonic()
    me = Peer(initial_peers=[initial], listen=f"/ip4/{host}/tcp/0")
    paths = me.nat.direct_paths if me.nat is not None else None
    line: dict[str, object] = {"ok": False, "start_s": round(time.monotonic() - started, 2)}
    started = time.monotonic()
    try:
        async def info() -> str:
            return (await me.pool.get(target).info()).peer_id

        line["ok"] = bool(me.run(info(), timeout=20))
        line["first_call_s"] = round(time.monotonic() - started, 2)
        line["ok"] = line["ok"] and bool(load_state_from_peers(me, "lab", [target], timeout=30).tensors)

        async def round_trips() -> list[float]:  # on the path the channel took (punched or relayed)
            times = []
            for _ in range(RTT_CALLS):
                sent = time.perf_counter()
                await me.pool.get(target).info()
                times.append(time.perf_counter() - sent)
            return times

        line["rtt_ms"] = round(statistics.median(me.run(round_trips(), timeout=60)) * 1e3, 1)

        async def fresh_connection() -> tuple[float, bool]:  # what a first call's connection costs (no TLS)
            fresh = holepunch.DirectPaths(me.nat.public_ip if me.nat is not None else lambda: None)
            sent = time.perf_counter()
            sock = await fresh.dial(Multiaddr.parse(target), relay.GRPC_PORT, 10.0)
            sock.close()
            return time.perf_counter() - sent, bool(fresh.direct)

        took, punched = me.run(fresh_connection(), timeout=30)
        line["connect_s"], line["connect_punched"] = round(took, 2), punched
    except Exception as e:  # noqa: BLE001 - reported
        line["error"] = f"{type(e).__name__}: {e}"
    if paths is not None:
        line.update(direct=sum(paths.direct.values()), relayed=sum(paths.relayed.values()), why=paths.last_error)
    print(json.dumps(line), flush=True)
    me.shutdown()


def swarm_main() -> None:
    import subprocess

    from swarm.testing import HostSpec, Lab, LinkProfile

    link = LinkProfile(delay_ms=5)
    print("| caller (A) | callee (B) | call and state download | connections punched / relayed | peer start "
          "| a fresh connection: set-up, path | Info RTT (median) |")
    print("|---|---|---|---|---|---|---|")
    for kind_a, kind_b in [("public", "masquerade"), ("masquerade", "masquerade"), ("random", "masquerade"),
                           ("masquerade", "random"), ("random", "random")]:
        specs = [HostSpec("relay", link)]
        for name, kind in (("a", kind_a), ("b", kind_b)):
            specs.append(HostSpec(name, link, nat=kind != "public", nat_type=kind if kind != "public" else "masquerade"))
        with Lab(specs, seed=1) as lab:
            relay = lab.spawn("relay", [sys.executable, "-m", "swarm", "--listen", f"/ip4/{lab.address('relay')}/tcp/0",
                                        "--log-level", "WARNING"])
            relay_addr = relay.stdout.readline().decode().strip()  # type: ignore[union-attr]
            server = lab.spawn("b", [sys.executable, __file__, "swarm-serve", lab.address("b"), relay_addr],
                               stdin=subprocess.PIPE)
            target = json.loads(server.stdout.readline())["addr"]  # type: ignore[union-attr]
            done = lab.exec("a", [sys.executable, __file__, "swarm-call", lab.address("a"), relay_addr, target],
                            timeout=120)
            result = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {"ok": False}
            server.stdin.write(b"stop\n")  # type: ignore[union-attr]
            server.stdin.flush()  # type: ignore[union-attr]
        print(f"| {kind_a} | {kind_b} | {'yes' if result.get('ok') else 'no: ' + str(result.get('error'))} | "
              f"{result.get('direct')} / {result.get('relayed')} | {result.get('start_s')} s | "
              f"{result.get('connect_s')} s, {'punched' if result.get('connect_punched') else 'relayed'} | "
              f"{result.get('rtt_ms')} ms |", flush=True)


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
    if len(sys.argv) > 3 and sys.argv[1] == "swarm-serve":
        swarm_serve(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 4 and sys.argv[1] == "swarm-call":
        swarm_call(sys.argv[2], sys.argv[3], sys.argv[4])
    elif "--swarm" in sys.argv:
        swarm_main()
    elif len(sys.argv) > 2 and sys.argv[1] == "observe":
        observe(sys.argv[2])
    elif len(sys.argv) > 2 and sys.argv[1] == "side":
        side(sys.argv[2])
    else:
        main()
