#!/usr/bin/env python
"""DHT benchmark. One run starts 16 `python -m swarm` daemons on loopback (one process
each) and a client-mode peer in this process that keeps no records and no cache, so every
operation it makes crosses the network. It reports, one line per figure:

  * store and get latency from one node, p50/p95 (one operation at a time, awaitable API). A store
    returns once the nearest replica holds the record and writes the others in the background:
    the store figure waits (untimed) for them before the next store, and a second figure starts
    each store right after the previous one returned;
  * CPU time of the client process per sequential store and get (steadier than latency on a
    loaded machine);
  * baselines from the same run: one Ping round trip (a get's floor) and `num_replicas` parallel
    Pings to distinct daemons (the requests of one store, all waited for);
  * concurrent stores/s and gets/s with 500 operations in flight;
  * join time of a new node (a full peer: server start, initial-peer ping, self-lookup), and of
    a new daemon process from launch to its address line;
  * memory per node: RSS of each DHT-only daemon after the run (and a check that none of them
    loaded torch, read from /proc/<pid>/maps);
  * the cost of disjoint-path lookups (`DHTConfig.disjoint_paths`): two more client-mode peers,
    one with one path and one with `--disjoint-paths` paths, take turns at the same gets (any
    value, and `latest=True`) and node lookups; p50/p95 of each and the requests per operation.

Usage: .venv/bin/python scripts/bench/bench_dht.py [--nodes 16] [--ops 1000] [--concurrent-ops 5000]
       [--no-multiplex] [--disjoint-paths 3] [--disjoint-ops 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

GOALS = {"store_p50": 2.0, "get_p50": 1.5, "stores_per_s": 1000, "gets_per_s": 2000, "rss_mb": 60}


def start_daemon(initial: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "swarm", "--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "WARNING"]
    for addr in initial:
        args += ["--initial-peers", addr]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, **env) if env else None)


def memory(pid: int) -> dict[str, float]:
    """RSS of a process and its parts (MB): anonymous (the heap: Python objects, malloc arenas,
    gRPC's buffers), file-backed (pages of the interpreter and shared libraries, shared with every
    process on the host that maps them), and its thread count (each thread may get a malloc arena)."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) / 1024
            elif key == "Threads":
                out[key] = int(value)
    return out


def memory_line(label: str, samples: list[dict[str, float]]) -> str:
    def med(key: str) -> float:
        return statistics.median(s.get(key, 0.0) for s in samples)

    return (f"{label}: RSS median {med('VmRSS'):.1f} MB, max {max(s['VmRSS'] for s in samples):.1f} MB"
            f" (anonymous {med('RssAnon'):.1f}, file-backed {med('RssFile'):.1f}, shmem {med('RssShmem'):.1f};"
            f" {med('Threads'):.0f} threads; {len(samples)} daemons)")


def read_addr(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline().strip()
    if not line.startswith("/ip4/"):
        raise RuntimeError(f"daemon {proc.pid} did not start (exit {proc.poll()})")
    return line


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def loaded_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("torch" in line for line in f)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latencies(dht, ops: int) -> dict[str, list[float] | float]:
    """Sequential stores and gets, one at a time.

    Stores are timed twice: "store" waits, untimed, for the previous store's last replicas
    (written in the background after it returned) before the next one starts, so each store
    meets an idle swarm as every operation did before stores returned early; "store_b2b" starts
    each store as soon as the previous one returned. Also the client process's CPU seconds per op.
    """
    from swarm.core.timeutil import get_dht_time

    expiration = get_dht_time() + 600
    stores, back_to_back, gets = [], [], []
    cpu = time.process_time()
    for i in range(ops):
        t0 = time.perf_counter()
        ok = await dht.astore(f"lat-{i}", {"i": i, "payload": "x" * 64}, expiration)
        stores.append(time.perf_counter() - t0)
        assert ok, i
        await dht.node.wait_for_stores()
    store_cpu = (time.process_time() - cpu) / ops
    for i in range(ops):
        t0 = time.perf_counter()
        ok = await dht.astore(f"b2b-{i}", {"i": i, "payload": "x" * 64}, expiration)
        back_to_back.append(time.perf_counter() - t0)
        assert ok, i
    await dht.node.wait_for_stores()
    cpu = time.process_time()
    for i in range(ops):
        t0 = time.perf_counter()
        found = await dht.aget(f"lat-{i}")
        gets.append(time.perf_counter() - t0)
        assert found is not None and found.value["i"] == i, i
    get_cpu = (time.process_time() - cpu) / ops
    return {"store": stores, "store_b2b": back_to_back, "get": gets, "store_cpu": store_cpu, "get_cpu": get_cpu}


async def throughput(dht, count: int, in_flight: int) -> tuple[float, float]:
    from swarm.core.timeutil import get_dht_time

    expiration = get_dht_time() + 600
    limit = asyncio.Semaphore(in_flight)
    failures = 0

    async def one(operation) -> None:
        nonlocal failures
        async with limit:
            if not await operation:
                failures += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(dht.astore(f"tp-{i}", i, expiration)) for i in range(count)))
    stores = count / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(dht.aget(f"tp-{i}")) for i in range(count)))
    gets = count / (time.perf_counter() - t0)
    if failures:
        print(f"warning: {failures} of {2 * count} concurrent operations failed", flush=True)
    return stores, gets


async def ping_floor(peer, addrs: list[str], calls: int, fan_out: int = 1) -> list[float]:
    """Round trips of `fan_out` parallel Pings to distinct daemons: what a get (1) and a store
    (one request per replica) cannot beat."""
    from swarm.core.multiaddr import Multiaddr
    from swarm.dht.buckets import NodeInfo
    from swarm.dht.wire import node_id_of

    protocol = peer.dht.node.protocol
    nodes = []
    for text in addrs:
        addr = Multiaddr.parse(text)
        nodes.append(NodeInfo(node_id_of(addr.peer_id), addr.peer_id, str(addr)))
    times = []
    for i in range(calls):
        targets = [nodes[(i + j) % len(nodes)] for j in range(fan_out)]
        t0 = time.perf_counter()
        assert all(await asyncio.gather(*(protocol.call_ping(node) for node in targets)))
        times.append(time.perf_counter() - t0)
    return times


async def timed(operation) -> float:
    t0 = time.perf_counter()
    await operation
    return time.perf_counter() - t0


def disjoint_cost(addrs: list[str], paths: int, ops: int, bucket_size: int) -> dict[str, dict[int, list[float]]]:
    """Latencies (seconds) of gets, latest gets and node lookups from a one-path and a `paths`-path
    client that take turns at the same operations; "requests" holds the Find requests of each latest get."""
    from swarm.core.timeutil import get_dht_time
    from swarm.dht import DHTConfig
    from swarm.dht.ids import DHTID
    from swarm.dht.protocol import FIND
    from swarm.peer import Peer

    clients = {d: Peer(initial_peers=addrs, client_mode=True, dht_config=DHTConfig(
        cache_size=0, disjoint_paths=d, bucket_size=bucket_size, num_replicas=min(5, bucket_size)))
               for d in (1, paths)}
    figures: dict[str, dict[int, list[float]]] = {name: {d: [] for d in clients}
                                                  for name in ("get", "get_latest", "lookup", "requests")}
    try:
        writer = clients[1]
        expiration = get_dht_time() + 600

        async def seed() -> None:
            await asyncio.gather(*(writer.dht.astore(f"dj-{i}", i, expiration) for i in range(ops)))

        writer.run(seed())
        writer.run(writer.dht.node.wait_for_stores())
        for peer in clients.values():
            peer.run(peer.dht.aget_many([f"warm-{i}" for i in range(200)]))  # channels to every daemon
        for i in range(ops):
            for d, peer in clients.items():
                node = peer.dht.node
                figures["get"][d].append(peer.run(timed(peer.dht.aget(f"dj-{i}"))))
                sent = node.protocol.calls_sent[FIND]
                figures["get_latest"][d].append(peer.run(timed(peer.dht.aget(f"dj-{i}", latest=True))))
                figures["requests"][d].append(float(node.protocol.calls_sent[FIND] - sent))
                key = DHTID.generate()
                figures["lookup"][d].append(peer.run(timed(node.find_nearest_nodes([key]))))
    finally:
        for peer in clients.values():
            peer.shutdown()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--ops", type=int, default=1000, help="sequential stores, then gets, for latency")
    parser.add_argument("--concurrent-ops", type=int, default=5000, help="stores, then gets, for throughput")
    parser.add_argument("--in-flight", type=int, default=500)
    parser.add_argument("--joins", type=int, default=5)
    parser.add_argument("--disjoint-paths", type=int, default=3,
                        help="paths of the disjoint-lookup client compared with a one-path client (0: skip)")
    parser.add_argument("--disjoint-ops", type=int, default=300)
    parser.add_argument("--disjoint-bucket-size", type=int, default=20,
                        help="k of both disjoint-lookup clients (below the node count, lookups do not ask every node)")
    parser.add_argument("--no-multiplex", action="store_true",
                        help="the client sends every call as a gRPC unary call of its own (the transport before "
                             "swarm.net.calls), for comparison")
    parser.add_argument("--compare-env", default="", metavar="VAR=VALUE",
                        help="start every second daemon with this environment variable (e.g. MALLOC_ARENA_MAX=2) "
                             "and report the memory of both halves, under the same load")
    args = parser.parse_args()
    other_env = dict([args.compare_env.split("=", 1)]) if args.compare_env else None

    from swarm.dht import DHTConfig
    from swarm.net.channels import ChannelConfig
    from swarm.peer import Peer

    daemons = [start_daemon([])]
    client = None
    try:
        addrs = [read_addr(daemons[0])]
        rest = [start_daemon(addrs[:1], other_env if i % 2 == 0 else None) for i in range(args.nodes - 1)]
        daemons += rest
        addrs += [read_addr(p) for p in rest]
        idle = [memory(p.pid) for p in daemons]
        client = Peer(initial_peers=addrs, client_mode=True, dht_config=DHTConfig(cache_size=0),
                      channel_config=ChannelConfig(multiplex=not args.no_multiplex))
        dht = client.dht
        client.run(dht.aget_many([f"warm-{i}" for i in range(200)]))  # channels and handshakes to all
        floor = client.run(ping_floor(client, addrs, 500))
        fan_floor = client.run(ping_floor(client, addrs, 500, fan_out=client.dht.config.num_replicas))
        lat = client.run(latencies(dht, args.ops))
        stores, back_to_back, gets = lat["store"], lat["store_b2b"], lat["get"]
        stores_per_s, gets_per_s = client.run(throughput(dht, args.concurrent_ops, args.in_flight))

        joins = []
        for _ in range(args.joins):
            t0 = time.perf_counter()
            newcomer = Peer(initial_peers=[addrs[len(joins) % len(addrs)]])
            joins.append(time.perf_counter() - t0)
            newcomer.shutdown()
        t0 = time.perf_counter()
        late = start_daemon(addrs[:1])
        read_addr(late)
        daemon_join = time.perf_counter() - t0
        late.terminate()
        late.wait(10)

        disjoint = disjoint_cost(
            addrs, args.disjoint_paths, args.disjoint_ops, args.disjoint_bucket_size) if args.disjoint_paths > 1 else None
        rss = [rss_mb(p.pid) for p in daemons]
        loaded = [memory(p.pid) for p in daemons]
        if other_env is not None:
            for label, pick in ((f"with {args.compare_env}", 1), ("without", 0)):
                idle_half = [m for i, m in enumerate(idle) if i % 2 == pick]
                loaded_half = [m for i, m in enumerate(loaded) if i % 2 == pick]
                print(memory_line(f"daemons {label}, just started", idle_half))
                print(memory_line(f"daemons {label}, after the load", loaded_half))
        else:
            print(memory_line("daemons just started", idle))
            print(memory_line("daemons after the load", loaded))
        torch_loaded = [p.pid for p in daemons if loaded_torch(p.pid)]
    finally:
        if client is not None:
            client.shutdown()
        for proc in daemons:
            proc.terminate()
        for proc in daemons:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    ms = 1e3
    print(f"nodes: {args.nodes} daemons (one process each) + 1 client-mode peer issuing every operation, no cache"
          + (", every call a gRPC unary call of its own" if args.no_multiplex else ""))
    print(f"baseline, one Ping round trip (a get's floor, same run): p50 {percentile(floor, .5) * ms:.3f} ms, "
          f"p95 {percentile(floor, .95) * ms:.3f} ms")
    print(f"baseline, {client.dht.config.num_replicas} parallel Pings to distinct daemons (one store's requests): "
          f"p50 {percentile(fan_floor, .5) * ms:.3f} ms, p95 {percentile(fan_floor, .95) * ms:.3f} ms")
    print(f"store latency p50: {percentile(stores, .5) * ms:.3f} ms (goal <= {GOALS['store_p50']} ms; hivemind ~19 ms)")
    print(f"store latency p95: {percentile(stores, .95) * ms:.3f} ms")
    print(f"store latency back-to-back (each store overlaps the last replicas of the one before) p50: "
          f"{percentile(back_to_back, .5) * ms:.3f} ms, p95 {percentile(back_to_back, .95) * ms:.3f} ms")
    print(f"get latency p50: {percentile(gets, .5) * ms:.3f} ms (goal <= {GOALS['get_p50']} ms; hivemind 3-5 ms)")
    print(f"get latency p95: {percentile(gets, .95) * ms:.3f} ms")
    print(f"client CPU per sequential store / get: {lat['store_cpu'] * ms:.3f} / {lat['get_cpu'] * ms:.3f} ms")
    print(f"concurrent stores, {args.in_flight} in flight: {stores_per_s:,.0f} /s "
          f"(goal >= {GOALS['stores_per_s']:,}; hivemind ~50)")
    print(f"concurrent gets, {args.in_flight} in flight: {gets_per_s:,.0f} /s "
          f"(goal >= {GOALS['gets_per_s']:,}; hivemind ~200-350)")
    print(f"join time of a new node (full peer, in process): median {statistics.median(joins) * ms:.1f} ms, "
          f"max {max(joins) * ms:.1f} ms over {len(joins)} joins")
    print(f"join time of a new daemon process (launch to address printed): {daemon_join * ms:.0f} ms")
    print(f"memory per DHT-only daemon (RSS): median {statistics.median(rss):.1f} MB, max {max(rss):.1f} MB "
          f"(goal <= {GOALS['rss_mb']} MB; hivemind ~99 MB)")
    print("RSS per daemon, in start order (the first is every other's initial peer): "
          + " ".join(f"{r:.1f}" for r in rss))
    print(f"daemons that loaded torch: {len(torch_loaded)} of {len(daemons)} (must be 0)")
    if disjoint is not None:
        d = args.disjoint_paths
        for name, label in (("get", "get (any value)"), ("get_latest", "get latest=True"), ("lookup", "node lookup")):
            one, many = disjoint[name][1], disjoint[name][d]
            print(f"disjoint paths (k = {args.disjoint_bucket_size}), {label}: 1 path p50 {percentile(one, .5) * ms:.3f} ms, p95 "
                  f"{percentile(one, .95) * ms:.3f} ms; {d} paths p50 {percentile(many, .5) * ms:.3f} ms, p95 "
                  f"{percentile(many, .95) * ms:.3f} ms (p50 ratio {percentile(many, .5) / percentile(one, .5):.2f}x)")
        requests = disjoint["requests"]
        print(f"disjoint paths, requests per get latest=True: 1 path {statistics.mean(requests[1]):.1f}, "
              f"{d} paths {statistics.mean(requests[d]):.1f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
