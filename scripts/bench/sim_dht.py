#!/usr/bin/env python
"""DHT simulation (issue #3): up to 200 nodes in one process, over the real protocol code.

Every node is a real `swarm.Peer` with its own gRPC server on port 0; all of them share one
event-loop thread. Links misbehave through the DHT's fault hook (`swarm.dht.FaultPlan`): every
request is delayed by `--delay` + up to `--jitter` seconds and lost with probability `--loss`
(the caller then waits out its timeout, as it would for a lost packet). Nodes keep no cache, so
every get is a real lookup.

The network grows to each size in `--sizes` (joins run on clean links); at each size the script
stores keys and looks them up from nodes that hold no copy, and reports, one line per size: the
success rate, the lookup's sequential steps (hops: mean, p95, max), requests per lookup, and
latency, next to log2(N), so that the O(log N) growth can be read off. Node lookups (§2.3
FIND_NODE for random IDs) are reported the same way.

Usage: .venv/bin/python scripts/bench/sim_dht.py [--sizes 25,50,100,200] [--lookups 200]
       [--loss 0.05] [--delay 0.002] [--jitter 0.003] [--bucket-size 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import resource
import statistics
import sys
import time
from collections import Counter


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="25,50,100,200")
    parser.add_argument("--lookups", type=int, default=200, help="gets (and node lookups) measured per size")
    parser.add_argument("--keys", type=int, default=50, help="keys stored per size")
    parser.add_argument("--loss", type=float, default=0.05)
    parser.add_argument("--delay", type=float, default=0.002)
    parser.add_argument("--jitter", type=float, default=0.003)
    parser.add_argument("--bucket-size", type=int, default=20)
    parser.add_argument("--request-timeout", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    raise_fd_limit()

    from swarm.core.identity import Identity
    from swarm.core.timeutil import get_dht_time
    from swarm.dht import DHTConfig, FaultPlan, LinkFault
    from swarm.dht.ids import DHTID
    from swarm.dht.keys import key_to_bytes, serialize_key
    from swarm.peer import Peer

    rng = random.Random(args.seed)
    plan = FaultPlan(seed=args.seed)
    lossy = LinkFault(delay=args.delay, jitter=args.jitter, loss=args.loss)
    config = DHTConfig(
        bucket_size=args.bucket_size, request_timeout=args.request_timeout, lookup_timeout=10.0,
        cache_size=0, refresh_interval=3600, republish_interval=3600, fault_plan=plan,
    )
    peers: list[Peer] = []

    def add_peer() -> None:
        identity = Identity.from_seed(rng.randbytes(32))
        initial = [rng.choice(peers).addrs[0]] if peers else []
        loop = peers[0].loop if peers else None
        peers.append(Peer(initial_peers=initial, identity=identity, dht_config=config, loop=loop))

    print(f"links: delay {args.delay * 1e3:.1f} ms + up to {args.jitter * 1e3:.1f} ms, loss {args.loss:.0%}, "
          f"request timeout {args.request_timeout} s; k = {args.bucket_size}, alpha = {config.alpha}, "
          f"replicas = {config.num_replicas}; no caches", flush=True)
    try:
        for size in sizes:
            t0 = time.perf_counter()
            while len(peers) < size:
                add_peer()
            join_s = time.perf_counter() - t0
            plan.default = lossy
            lost_before = plan.stats.lost
            now = get_dht_time()
            keys = [f"sim-{size}-{i}" for i in range(args.keys)]
            writer = rng.choice(peers)
            stored = writer.dht.store_many(keys, list(range(len(keys))), now + 3600)

            hops: list[int] = []
            requests: list[int] = []
            latencies: list[float] = []
            successes = 0
            for _ in range(args.lookups):
                key = rng.choice(keys)
                raw = serialize_key(key)
                reader = rng.choice([p for p in peers if p.dht.node.storage.get(key_to_bytes(key)) is None])
                node = reader.dht.node
                before_hops, before_requests = Counter(node.stats.hops), node.stats.requests
                t1 = time.perf_counter()
                found = reader.run(node.get_many([raw]))
                latencies.append(time.perf_counter() - t1)
                successes += found.get(raw) is not None
                delta = node.stats.hops - before_hops
                hops.extend(delta.elements())
                requests.append(node.stats.requests - before_requests)

            node_hops: list[int] = []
            node_requests: list[int] = []
            for _ in range(args.lookups // 4):
                reader = rng.choice(peers)
                node = reader.dht.node
                before_hops, before_requests = Counter(node.stats.hops), node.stats.requests
                reader.run(node.find_nearest_nodes([DHTID.generate(rng=rng)]))
                node_hops.extend((node.stats.hops - before_hops).elements())
                node_requests.append(node.stats.requests - before_requests)
            plan.default = LinkFault()

            log_n = math.log2(size)
            print(
                f"N={size:4d} log2(N)={log_n:4.1f}: get success {successes}/{args.lookups} "
                f"({successes / args.lookups:.1%}), hops mean {statistics.mean(hops):.2f} "
                f"p95 {percentile(hops, .95):.0f} max {max(hops)}, requests/lookup {statistics.mean(requests):.1f}, "
                f"latency p50 {percentile(latencies, .5) * 1e3:.1f} ms p95 {percentile(latencies, .95) * 1e3:.1f} ms; "
                f"node lookup hops mean {statistics.mean(node_hops):.2f} max {max(node_hops)}, "
                f"requests {statistics.mean(node_requests):.1f}; "
                f"stored {sum(stored)}/{len(keys)}; requests lost {plan.stats.lost - lost_before}; "
                f"joins {join_s:.1f} s",
                flush=True,
            )
    finally:
        for peer in reversed(peers):
            peer.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
