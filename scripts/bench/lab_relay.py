"""Relayed vs direct, in the same run, in the network lab (docs/relay.md; figures in BENCHMARKS.md).

Three hosts: `relay` (a public peer that relays), `callee` (a peer that holds a reservation on
the relay and still listens on its own address, so both paths reach the same process), `caller`.
The caller measures, on each path: the round trip of a small unary call (Info, median of 200) and
the throughput of a bulk stream echoing 8 MiB messages (the tensor path; TLS end to end either way).

    sudo .venv/bin/python scripts/bench/lab_relay.py [--delay-ms 5] [--mbit 0] [--rounds 5]

Needs root (the lab). Run on a loaded machine, compare the ratio, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

ECHO = "/bench.Relay/Echo"


def run_relay(host: str, share: float) -> None:
    from swarm.net.nat import NatConfig
    from swarm.net.relay import RelayConfig
    from swarm.peer import Peer

    limits = RelayConfig(max_bytes_per_s=share * 1e6 if share else None)
    peer = Peer(listen=f"/ip4/{host}/tcp/0", nat=NatConfig(reachability="public", relay_limits=limits))
    print(peer.addrs[0], flush=True)
    sys.stdin.read()
    peer.shutdown()


def serve(relay_addr: str) -> None:
    from swarm.net.nat import NatConfig
    from swarm.peer import Peer

    peer = Peer(initial_peers=[relay_addr], listen=f"/ip4/{sys.argv[3]}/tcp/0", nat=NatConfig(reachability="private"))

    async def echo(requests, ctx):
        async for message in requests:
            yield bytes(message)

    peer.server.add_stream(ECHO, echo, bulk=True)
    direct = f"/ip4/{sys.argv[3]}/tcp/{peer.server.port}/p2p/{peer.peer_id}"
    print(json.dumps({"direct": direct, "relayed": peer.addrs[0]}), flush=True)
    sys.stdin.read()
    peer.shutdown()


def measure(direct: str, relayed: str, rounds: int) -> None:
    from swarm.peer import Peer

    peer = Peer(relay=False)
    size = 8 << 20
    payload = bytes(size)

    async def run(addr: str) -> dict[str, float]:
        channel = peer.pool.get(addr)
        await channel.info()
        rtts = []
        for _ in range(200):
            started = time.perf_counter()
            await channel.info()
            rtts.append(time.perf_counter() - started)
        async for _ in channel.stream(ECHO, [payload], timeout=60, bulk=True):  # warm the bulk connection
            pass
        started = time.perf_counter()
        for _ in range(rounds):
            async for _ in channel.stream(ECHO, [payload], timeout=60, bulk=True):
                pass
        elapsed = time.perf_counter() - started
        return {"rtt_ms": statistics.median(rtts) * 1000, "echo_MBps": 2 * size * rounds / elapsed / 1e6,
                "bulk": bool(channel.bulk_reachable)}

    async def both() -> dict[str, dict[str, float]]:
        figures: dict[str, dict[str, float]] = {}
        for _ in range(2):  # alternating, twice; the second pass is reported (warm caches, both paths)
            figures = {"direct": await run(direct), "relayed": await run(relayed)}
        return figures

    print(json.dumps(peer.run(both(), timeout=600)), flush=True)
    peer.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, default=5.0, help="one-way delay of each host's link")
    parser.add_argument("--mbit", type=float, default=0.0, help="each link's bandwidth (0: unlimited)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--relay-share", type=float, default=0.0,
                        help="the relay's bandwidth share in MB/s (0: unlimited, to measure the relay itself)")
    args = parser.parse_args()
    from swarm.testing import HostSpec, Lab, LinkProfile

    link = LinkProfile(up_mbit=args.mbit or None, down_mbit=args.mbit or None, delay_ms=args.delay_ms)
    with Lab([HostSpec(h, link) for h in ("relay", "callee", "caller")], seed=1) as lab:
        relay = lab.spawn("relay", [sys.executable, __file__, "relay", lab.address("relay"), str(args.relay_share)],
                          stdin=subprocess.PIPE)
        assert relay.stdout is not None
        relay_addr = relay.stdout.readline().decode().strip()
        callee = lab.spawn("callee", [sys.executable, __file__, "serve", relay_addr, lab.address("callee")],
                           stdin=subprocess.PIPE)
        assert callee.stdout is not None
        addrs = json.loads(callee.stdout.readline())
        result = lab.exec("caller", [sys.executable, __file__, "measure", addrs["direct"], addrs["relayed"],
                                     str(args.rounds)], timeout=600)
        if result.returncode:
            raise SystemExit(result.stderr[-3000:])
        figures = json.loads(result.stdout.strip().splitlines()[-1])
    d, r = figures["direct"], figures["relayed"]
    print(f"links: {args.delay_ms} ms one way each (direct RTT {4 * args.delay_ms:.0f} ms), "
          f"{args.mbit or 'unlimited'} Mbit/s")
    print("| path | Info RTT (median) | 8 MiB bulk echo |")
    print("|---|---|---|")
    for name, f in (("direct", d), ("relayed", r)):
        print(f"| {name} | {f['rtt_ms']:.1f} ms | {f['echo_MBps']:.0f} MB/s{'' if f['bulk'] else ' (gRPC)'} |")
    print(f"relayed / direct: RTT x{r['rtt_ms'] / d['rtt_ms']:.2f}, throughput x{r['echo_MBps'] / d['echo_MBps']:.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "relay":
        run_relay(sys.argv[2], float(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "measure":
        measure(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
