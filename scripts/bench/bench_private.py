#!/usr/bin/env python
"""Benchmark: what a private swarm costs against an open one, in one invocation (docs/security.md,
"Private swarms"; goals in SPEC.md: connection set-up <= 1.10x, small-RPC p50 <= 1.02x).

Two server peers run in one process: an open one, and a private one (certificates). A client
dials each in turn with a fresh channel pool, so each dial is a new TCP connection and TLS
handshake; in the private swarm the first call also carries the client's certificate and the
channel asks the callee for its own (one extra round trip). Then, on connected channels, it
times small unary calls (`Info`, multiplexed on the Calls stream) in alternating blocks.

- `setup`: a new channel to the first answered `Info` call (TCP, TLS, proofs both ways, the call).
- `rpc p50`: one `Info` call on a connected channel.

    .venv/bin/python scripts/bench/bench_private.py [--dials 200] [--calls 4000] [--block 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from swarm.core.identity import Identity
from swarm.core.membership import Authority, CertificatePolicy
from swarm.net.channels import ChannelPool
from swarm.net.membership import MembershipGate
from swarm.peer import Peer
from swarm.proto import peer_pb2

INFO = "/swarm.Peer/Info"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dials", type=int, default=200, help="new connections per mode")
    parser.add_argument("--calls", type=int, default=4000, help="small calls per mode")
    parser.add_argument("--block", type=int, default=200, help="calls per alternating block")
    args = parser.parse_args()

    authority = Authority.generate()
    server_identity, client_identity = Identity.generate(), Identity.generate()
    open_server = Peer(relay=False)
    private_server = Peer(identity=server_identity, relay=False, swarm_authority=authority.public_text,
                          membership=authority.invite(server_identity.peer_id, ["trainer"], 86400))
    client = Peer(client_mode=True)  # owns the loop the client pools run on
    policy = CertificatePolicy(authority.public_key, authority.invite(client_identity.peer_id, ["trainer"], 86400))
    gate = MembershipGate(policy)
    targets = {"open": (open_server.addrs[0], None), "private": (private_server.addrs[0], gate)}

    async def dial(mode: str) -> float:
        addr, mode_gate = targets[mode]
        pool = ChannelPool(client_identity, gate=mode_gate)
        try:
            started = time.perf_counter()
            await pool.get(addr).unary(INFO, peer_pb2.InfoRequest(), peer_pb2.PeerInfo, timeout=10)
            return time.perf_counter() - started
        finally:
            await pool.close()

    async def calls(pools: dict[str, ChannelPool], mode: str, n: int) -> list[float]:
        channel = pools[mode].get(targets[mode][0])
        request = peer_pb2.InfoRequest()
        out = []
        for _ in range(n):
            started = time.perf_counter()
            await channel.unary(INFO, request, peer_pb2.PeerInfo, timeout=10)
            out.append(time.perf_counter() - started)
        return out

    async def run() -> None:
        for mode in targets:  # warm up: imports, caches, the first handshakes
            for _ in range(5):
                await dial(mode)
        setup: dict[str, list[float]] = {m: [] for m in targets}
        for i in range(args.dials):
            order = list(targets) if i % 2 == 0 else list(reversed(targets))
            for mode in order:
                setup[mode].append(await dial(mode))
        pools = {"open": ChannelPool(client_identity), "private": ChannelPool(client_identity, gate=gate)}
        latency: dict[str, list[float]] = {m: [] for m in targets}
        for mode in targets:
            await calls(pools, mode, 200)  # warm
        for i in range(max(1, args.calls // args.block)):
            order = list(targets) if i % 2 == 0 else list(reversed(targets))
            for mode in order:
                latency[mode] += await calls(pools, mode, args.block)
        for pool in pools.values():
            await pool.close()
        open_setup, private_setup = statistics.median(setup["open"]), statistics.median(setup["private"])
        open_rpc, private_rpc = statistics.median(latency["open"]), statistics.median(latency["private"])
        print(f"setup open p50: {open_setup * 1e3:.3f} ms  ({args.dials} dials)")
        print(f"setup private p50: {private_setup * 1e3:.3f} ms")
        print(f"setup private/open: {private_setup / open_setup:.3f}x  (goal <= 1.10x)")
        print(f"rpc open p50: {open_rpc * 1e6:.1f} us  ({len(latency['open'])} calls)")
        print(f"rpc private p50: {private_rpc * 1e6:.1f} us")
        print(f"rpc private/open: {private_rpc / open_rpc:.3f}x  (goal <= 1.02x)")

    try:
        client.run(run(), timeout=3600)
    finally:
        client.shutdown()
        private_server.shutdown()
        open_server.shutdown()


if __name__ == "__main__":
    main()
