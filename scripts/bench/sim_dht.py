#!/usr/bin/env python
"""DHT simulation (issues #3, #20): up to thousands of nodes under churn, over swarm's own DHT code.

Every node is a real `swarm.dht.DHT` (the node, its routing table, storage, lookups, refresh,
republish, hand-off and goodbyes run unchanged); only the links and the clock are simulated
(`simnet.py`): virtual time, so that 30 minutes of churn cost only the CPU the messages need; an
access round trip per node from a log-normal distribution clipped to 10-300 ms (median 60 ms), a
link's round trip being the mean of its ends'; every message lost with probability `--loss`.
Nodes keep no cache, so every get is a real lookup.

For each size in `--sizes` the script builds a network of N nodes (joining in waves), stores
`--keys` records from random writers, then runs `--minutes` of churn: `--churn` of the N nodes
leave at random times (half say goodbye, half crash silently) and as many new nodes join, while
`--lookups` gets from random live nodes, spread over the run, look up random stored keys. It
prints one table line per size: lookup success; hops (sequential request steps until a node
returned the value) against log2(N); requests per lookup; virtual latency p50/p95; upkeep traffic
during the churn (everything but the measured gets: refreshes, pings, republishes, hand-offs,
goodbyes, and the joins of the newcomers) in messages and payload bytes per live node per minute;
the payload a node sent and answered while the network was built, per node (the cost of a join);
memory per node (the process's RSS growth while the network was built, divided by N); and the
wall time. Payload bytes are the protobuf messages; gRPC/HTTP/2/TCP framing comes on top. The
upkeep is also split by the activity that sent it (join, join far-bucket refresh, periodic refresh,
republish, hand-off, stale-contact pings, goodbyes). `--compare-refresh` runs every size twice:
bucket refreshes as full lookups (as before refreshes became cheap), then as they are now.

Usage: .venv/bin/python scripts/bench/sim_dht.py [--sizes 100,250,500,1000] [--minutes 30]
       [--churn 0.3] [--lookups 1000] [--keys 200] [--loss 0.02] [--seed 0] [--compare-refresh] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import simnet

simnet.install_virtual_time()  # before swarm is imported: some of it binds time.time as a default
simnet.share_parsing()


def attribute_upkeep() -> None:
    """Counts each node activity's traffic under its own name (the upkeep split by origin)."""
    from swarm.dht.contacts import Contacts
    from swarm.dht.handoff import Handoff
    from swarm.dht.node import DHTNode

    for cls, name, origin in (
        (DHTNode, "bootstrap", "join"), (DHTNode, "_refresh_far_buckets", "join-refresh"),
        (DHTNode, "refresh", "refresh"), (DHTNode, "republish", "republish"),
        (DHTNode, "_say_goodbye", "goodbye"), (Handoff, "_run", "handoff"), (Contacts, "_check_stale", "ping-stale"),
    ):
        simnet.attribute(cls, name, origin)


class Simulation:
    def __init__(self, args: argparse.Namespace, size: int, seed: int) -> None:
        from swarm.dht import DHTConfig

        self.args = args
        self.size = size
        self.rng = random.Random(seed)
        random.seed(seed)  # the DHT's own jitter (refresh and republish phases)
        self.net = simnet.SimNetwork(random.Random(seed + 1), loss=args.loss)
        self.config = DHTConfig(
            bucket_size=args.bucket_size, request_timeout=args.request_timeout, lookup_timeout=args.lookup_timeout,
            cache_size=0,
        )
        self.live: dict[str, simnet.SimPeer] = {}
        self.lookups: list[dict[str, Any]] = []
        self._record_hops: dict[str, list[tuple[int, int]]] = {}
        self.failed_joins = 0

    async def add_node(self) -> simnet.SimPeer | None:
        from swarm.core.identity import Identity

        peer = simnet.SimPeer(self.net, Identity.from_seed(self.rng.randbytes(32)))
        live = list(self.live.values())
        # a bootstrap list of a few live nodes (any of them answering is enough)
        initial = [n.addrs[0] for n in self.rng.sample(live, min(3, len(live)))]
        try:
            await peer.start_dht(self.config, initial)
        except Exception as e:  # noqa: BLE001 - a join that failed is counted, not fatal
            self.failed_joins += 1
            print(f"  join failed: {e}", file=sys.stderr)
            return None
        self._watch(peer)
        self.live[peer.peer_id] = peer
        return peer

    def _watch(self, node: simnet.SimPeer) -> None:
        """Routes the hops of the node's measured lookups (TAG "get") to the simulation."""
        stats = node.dht.node.stats
        original = stats.record
        hops = self._record_hops

        def record(h: int, requests: int, found: bool = False, timed_out: bool = False) -> None:
            original(h, requests, found=found, timed_out=timed_out)
            if simnet.TAG.get() == "get":
                hops.setdefault(node.peer_id, []).append((h, requests))

        stats.record = record

    async def remove_node(self, node: simnet.SimPeer, goodbye: bool) -> None:
        del self.live[node.peer_id]
        await (node.leave() if goodbye else node.crash())

    async def build(self) -> tuple[float, float]:
        """Returns the memory per node and the bytes sent per node while the network was built."""
        gc.collect()
        rss0 = simnet.rss_bytes()
        sent0 = self.net.traffic.bytes["upkeep"]
        await self.add_node()
        wave = self.args.join_wave
        while len(self.live) < self.size:
            await asyncio.gather(*(self.add_node() for _ in range(min(wave, self.size - len(self.live)))))
        await asyncio.sleep(60)  # the joiners' far-bucket refreshes finish
        gc.collect()
        return (simnet.rss_bytes() - rss0) / self.size, (self.net.traffic.bytes["upkeep"] - sent0) / self.size

    async def store_keys(self) -> list[str]:
        from swarm.core.timeutil import get_dht_time

        keys = [f"sim-key-{i}" for i in range(self.args.keys)]
        writers = self.rng.sample(list(self.live.values()), min(10, len(self.live)))
        expiration = get_dht_time() + 3 * 3600
        token = simnet.TAG.set("store")
        try:
            results = await asyncio.gather(*(
                w.dht.astore_many(keys[i::len(writers)], [f"value-{k}" for k in keys[i::len(writers)]], expiration)
                for i, w in enumerate(writers)
            ))
            for w in writers:
                await w.dht.node.wait_for_stores(30)
        finally:
            simnet.TAG.reset(token)
        stored = sum(sum(r) for r in results)
        if stored < len(keys):
            print(f"  only {stored}/{len(keys)} keys stored", file=sys.stderr)
        return keys

    async def one_lookup(self, keys: list[str]) -> None:
        reader = self.rng.choice(list(self.live.values()))
        key = self.rng.choice(keys)
        token = simnet.TAG.set("get")
        start = simnet.CLOCK.now
        try:
            found = await reader.dht.aget(key)
        finally:
            simnet.TAG.reset(token)
        hops = self._record_hops.pop(reader.peer_id, [])
        self.lookups.append({
            "ok": found is not None and found.value == f"value-{key}",
            "latency": simnet.CLOCK.now - start,
            "hops": hops[-1][0] if hops else None,
            "requests": sum(r for _, r in hops),
        })

    async def churn(self, keys: list[str]) -> dict[str, float]:
        args = self.args
        duration = args.minutes * 60
        changes = round(args.churn * self.size)
        events: list[tuple[float, str]] = []
        events += [(self.rng.uniform(0, duration), "goodbye" if i % 2 == 0 else "crash") for i in range(changes)]
        events += [(self.rng.uniform(0, duration), "join") for _ in range(changes)]
        events += [(self.rng.uniform(0, duration), "get") for _ in range(args.lookups)]
        events.sort()
        start = simnet.CLOCK.now
        before = dict(self.net.traffic.bytes), dict(self.net.traffic.messages)
        methods_before = Counter(self.net.traffic.by_tag_method)
        origins_before = Counter(self.net.traffic.by_origin), Counter(self.net.traffic.messages_by_origin)
        live_area = 0.0  # integral of live nodes over time
        last = start
        tasks: set[asyncio.Task[Any]] = set()
        for done, (at, kind) in enumerate(events):
            if done % max(1, len(events) // 5) == 0:
                print(f"  N={self.size}: churn {at / 60:.0f}/{args.minutes:g} virtual min, {len(self.live)} live, "
                      f"{time.process_time():.0f} s CPU", file=sys.stderr, flush=True)
            delay = start + at - simnet.CLOCK.now
            if delay > 0:
                await asyncio.sleep(delay)
            live_area += len(self.live) * (simnet.CLOCK.now - last)
            last = simnet.CLOCK.now
            if kind == "get":
                coro: Any = self.one_lookup(keys)
            elif kind == "join":
                coro = self.add_node()
            else:
                victim = self.rng.choice(list(self.live.values()))
                coro = self.remove_node(victim, goodbye=kind == "goodbye")
            task = asyncio.ensure_future(coro)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        end = start + duration
        if simnet.CLOCK.now < end:
            await asyncio.sleep(end - simnet.CLOCK.now)
        live_area += len(self.live) * (simnet.CLOCK.now - last)
        minutes = (simnet.CLOCK.now - start) / 60
        node_minutes = live_area / 60
        traffic = self.net.traffic
        upkeep_bytes = traffic.bytes["upkeep"] - before[0].get("upkeep", 0)
        upkeep_messages = traffic.messages["upkeep"] - before[1].get("upkeep", 0)
        methods = Counter(self.net.traffic.by_tag_method)
        methods.subtract(methods_before)
        breakdown = {m.rsplit("/", 1)[-1]: round(b / node_minutes) for (t, m), b in methods.items() if t == "upkeep"}
        by_origin: dict[str, list[float]] = {}
        for counter, before_counter, slot in ((traffic.by_origin, origins_before[0], 0),
                                              (traffic.messages_by_origin, origins_before[1], 1)):
            for (t, origin, m), n in counter.items():
                if t == "upkeep":
                    entry = by_origin.setdefault(f"{origin}:{m.rsplit('/', 1)[-1]}", [0.0, 0.0])
                    entry[slot] += (n - before_counter.get((t, origin, m), 0)) / node_minutes
        nodes = list(self.live.values())
        return {
            "upkeep_by_method": breakdown,
            "upkeep_by_origin": {k: [round(b), round(m, 2)] for k, (b, m) in by_origin.items() if b > 0},
            "buckets_per_node": statistics.mean(len(n.dht.node.routing_table.buckets) for n in nodes),
            "contacts_per_node": statistics.mean(len(n.dht.node.routing_table) for n in nodes),
            "minutes": minutes,
            "upkeep_bytes_per_node_min": upkeep_bytes / node_minutes,
            "upkeep_msgs_per_node_min": upkeep_messages / node_minutes,
        }

    async def shutdown(self) -> None:
        for node in list(self.live.values()):
            await node.crash()
        self.live.clear()

    async def run(self) -> dict[str, Any]:
        wall0 = time.perf_counter()
        memory, join_bytes = await self.build()
        build_s = time.perf_counter() - wall0
        print(f"  N={self.size}: built in {build_s:.0f} s", file=sys.stderr, flush=True)
        keys = await self.store_keys()
        upkeep = await self.churn(keys)
        await self.shutdown()
        ok = [lookup for lookup in self.lookups if lookup["ok"]]
        hops = [lookup["hops"] for lookup in ok if lookup["hops"] is not None]
        latencies = [lookup["latency"] for lookup in ok]
        return {
            "n": self.size,
            "log2n": math.log2(self.size),
            "lookups": len(self.lookups),
            "success": len(ok) / max(1, len(self.lookups)),
            "hops_mean": statistics.mean(hops) if hops else float("nan"),
            "hops_p95": simnet.percentile(hops, 0.95),
            "hops_max": max(hops, default=0),
            "requests": statistics.mean(lookup["requests"] for lookup in self.lookups) if self.lookups else 0,
            "latency_p50_ms": simnet.percentile(latencies, 0.5) * 1e3,
            "latency_p95_ms": simnet.percentile(latencies, 0.95) * 1e3,
            "memory_per_node_kib": memory / 1024,
            "join_kib_per_node": join_bytes / 1024,
            "failed_joins": self.failed_joins,
            "lost_messages": self.net.traffic.lost,
            "build_wall_s": build_s,
            "wall_s": time.perf_counter() - wall0,
            **upkeep,
        }


def print_result(r: dict[str, Any], show_policy: bool) -> None:
    ok = round(r["success"] * r["lookups"])
    print(f"{r['n']:5d} {r['log2n']:5.1f} {ok:>4}/{r['lookups']:<4} {r['hops_mean']:5.2f} {r['hops_p95']:3.0f} "
          f"{r['hops_max']:3d} {r['requests']:7.1f} {r['latency_p50_ms']:7.0f} {r['latency_p95_ms']:7.0f} "
          f"{r['upkeep_bytes_per_node_min']:17.0f} {r['upkeep_msgs_per_node_min']:13.1f} "
          f"{r['join_kib_per_node']:8.1f} {r['memory_per_node_kib']:8.0f} {r['wall_s']:6.0f}"
          + (f"  (refresh: {r['refresh']})" if show_policy else ""), flush=True)
    print("      upkeep B/node/min by method: " + ", ".join(
        f"{m} {b}" for m, b in sorted(r["upkeep_by_method"].items(), key=lambda kv: -kv[1])), flush=True)
    print("      upkeep B (msgs)/node/min by origin: " + ", ".join(
        f"{o} {b} ({m:g})" for o, (b, m) in sorted(r["upkeep_by_origin"].items(), key=lambda kv: -kv[1][0])),
        flush=True)
    print(f"      routing table per node: {r['buckets_per_node']:.1f} buckets, {r['contacts_per_node']:.0f} contacts",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100,250,500,1000")
    parser.add_argument("--minutes", type=float, default=30.0, help="virtual minutes of churn per size")
    parser.add_argument("--churn", type=float, default=0.3, help="fraction of N that leaves (and joins) over the run")
    parser.add_argument("--lookups", type=int, default=1000, help="gets measured per size, spread over the run")
    parser.add_argument("--keys", type=int, default=200, help="records stored before the churn")
    parser.add_argument("--loss", type=float, default=0.02, help="probability that a message is lost")
    parser.add_argument("--bucket-size", type=int, default=20)
    parser.add_argument("--request-timeout", type=float, default=3.0)
    parser.add_argument("--lookup-timeout", type=float, default=10.0)
    parser.add_argument("--join-wave", type=int, default=25, help="nodes joining at once while the network is built")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-refresh", action="store_true",
                        help="run every size twice: bucket refreshes as full lookups (as before refreshes became cheap), then cheap")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))

    import logging

    logging.basicConfig(level=logging.WARNING)
    attribute_upkeep()
    print(f"links: access RTT log-normal, median 60 ms, clipped to 10-300 ms; loss {args.loss:.0%} per message; "
          f"request timeout {args.request_timeout} s; k = {args.bucket_size}; no caches; "
          f"{args.minutes:g} virtual minutes of churn: {args.churn:.0%} of N leave (half goodbye, half crash) "
          f"and as many join; {args.lookups} gets of {args.keys} keys", flush=True)
    header = (f"{'N':>5} {'log2N':>5} {'success':>9} {'hops':>5} {'p95':>3} {'max':>3} {'req/get':>7} "
              f"{'p50 ms':>7} {'p95 ms':>7} {'upkeep B/node/min':>17} {'msgs/node/min':>13} {'join KiB':>8} {'KiB/node':>8} {'wall s':>6}")
    print(header, flush=True)
    from swarm.dht.node import DHTNode

    cheap_refresh = DHTNode._refresh_lookup
    policies = ["full", "cheap"] if args.compare_refresh else ["cheap"]
    results = []
    for i, size in enumerate(sizes):
        for policy in policies:
            # "full": the refresh as it was before it became cheap, a full lookup (k nodes must answer) per stale bucket
            DHTNode._refresh_lookup = cheap_refresh if policy == "cheap" else DHTNode.find_nearest_nodes
            r = simnet.run(Simulation(args, size, args.seed + 1000 * i).run())
            r["refresh"] = policy
            results.append(r)
            print_result(r, len(policies) > 1)
    for policy in policies:
        runs = [r for r in results if r["refresh"] == policy]
        if len(runs) > 1:
            a, b = runs[0], runs[-1]
            print(f"refresh {policy}: from N={a['n']} to N={b['n']} (x{b['n'] / a['n']:.0f}, "
                  f"log2N x{b['log2n'] / a['log2n']:.2f}): hops x{b['hops_mean'] / a['hops_mean']:.2f}, "
                  f"upkeep bytes/node/min x{b['upkeep_bytes_per_node_min'] / a['upkeep_bytes_per_node_min']:.2f}, "
                  f"latency p50 x{b['latency_p50_ms'] / a['latency_p50_ms']:.2f}, memory/node "
                  f"x{b['memory_per_node_kib'] / max(a['memory_per_node_kib'], 1e-9):.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
