#!/usr/bin/env python
"""Benchmark: butterfly all-reduce of 100 MB float32 per peer, peers as separate processes on loopback.

Prints one line per figure: seconds per round (median over rounds) for a minimal raw-socket
butterfly exchanging the same bytes (the ceiling), for swarm's averager with its tensors over
gRPC streams only (the transport before the bulk side channel), and for swarm's averager as it
runs by default (parts over the bulk side channel; float32 and float16 on the wire), all in the
same run, and peak RSS per peer. The averager runs over TLS (the default) and, in the same run,
plaintext (`--insecure` on every peer), and the ratio of the two is printed.

    .venv/bin/python scripts/bench/bench_averaging.py [--peers 4 8] [--mbytes 100] [--rounds 7]

A round's time is from the moment the last peer called `step` to the moment the last peer
returned (peers run back to back, so this is the time a round costs the group).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------------------------
# workers


def swarm_worker(args: argparse.Namespace) -> None:
    import torch

    from swarm.averaging import Averager, AveragerConfig
    from swarm.averaging.config import AllReduceConfig
    from swarm.peer import Peer

    torch.set_num_threads(1)
    if os.environ.get("BENCH_DEBUG"):
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)d %(name)s %(message)s")
        logging.getLogger("swarm.averaging").setLevel(logging.DEBUG)
        logging.getLogger("swarm.net").setLevel(logging.DEBUG)
    from swarm.net import sealed
    from swarm.net.channels import ChannelConfig

    if args.seal:  # else the default: workers where the process has more than 2 cores
        sealed.OFF_LOOP = args.seal == "workers"
    peer = Peer(insecure=args.insecure, channel_config=ChannelConfig(bulk_pool=not args.no_pool))
    baseline = _rss_mb()
    print(json.dumps({"addr": peer.addrs[0]}), flush=True)
    addrs = json.loads(sys.stdin.readline())["addrs"]
    numel = args.mbytes * (1 << 20) // 4
    tensors = [torch.randn(numel)]
    if os.environ.get("BENCH_DEBUG"):
        print(f"with tensors: rss {_rss_mb():.0f} MB (baseline {baseline:.0f})", file=sys.stderr, flush=True)
    config = AveragerConfig(compression=args.compression, allreduce=AllReduceConfig(bulk=args.transport == "bulk"))
    avg = Averager(peer, tensors, initial_group=addrs, target_group_size=len(addrs), min_group_size=len(addrs),
                   config=config)
    profiler = None
    if os.environ.get("BENCH_PROFILE") and args.index == 0:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # the loop thread's CPU time: the host is shared, and
        # the sealing workers run at the same time (swarm.net.sealed)

        async def toggle(on: bool) -> None:
            profiler.enable() if on else profiler.disable()

        peer.run(toggle(True))
    times, failures, cpu = [], [], []
    for _ in range(args.rounds + 1):
        start, cpu_start = time.time(), time.process_time()
        try:
            avg.step(timeout=60)
        except Exception as e:  # noqa: BLE001 - reported, the benchmark goes on
            failures.append(str(e))
            continue
        times.append((start, time.time()))
        cpu.append(time.process_time() - cpu_start)
        if os.environ.get("BENCH_DEBUG"):
            print(f"rss {_rss_mb():.0f} MB, peak {_peak_mb():.0f} MB", file=sys.stderr, flush=True)
    if profiler is not None:
        import pstats

        peer.run(toggle(False))
        if os.environ["BENCH_PROFILE"].endswith(".prof"):  # kept whole, for pstats or snakeviz
            profiler.dump_stats(os.environ["BENCH_PROFILE"])
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    print(json.dumps({"times": times[1:], "cpu": cpu[1:], "baseline_mb": baseline, "peak_mb": _peak_mb(),
                      "tensor_mb": numel * 4 / 2**20, "failures": failures}), flush=True)
    sys.stdin.readline()
    peer.shutdown()


def raw_worker(args: argparse.Namespace) -> None:
    """Butterfly over plain TCP: one connection per pair, recv_into preallocated buffers."""
    import torch

    torch.set_num_threads(1)
    index, n = args.index, args.n
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(n)
    print(json.dumps({"addr": f"127.0.0.1:{listener.getsockname()[1]}"}), flush=True)
    addrs = json.loads(sys.stdin.readline())["addrs"]
    numel = args.mbytes * (1 << 20) // 4
    data = torch.randn(numel)
    bounds = [numel * j // n for j in range(n + 1)]
    own = bounds[index + 1] - bounds[index]
    socks: dict[int, socket.socket] = {}
    for j in range(n):  # lower index dials higher index
        if j > index:
            host, port = addrs[j].split(":")
            s = socket.create_connection((host, int(port)))
            s.sendall(index.to_bytes(4, "little"))
            socks[j] = s
    for _ in range(index):
        s, _addr = listener.accept()
        j = int.from_bytes(s.recv(4, socket.MSG_WAITALL), "little")
        socks[j] = s
    for s in socks.values():
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    slots = torch.empty((n, own))
    result = torch.empty(numel)
    chunk = 1 << 20

    def send(s: socket.socket, t: torch.Tensor) -> None:
        view = _bytes_view(t)
        for off in range(0, len(view), chunk):
            s.sendall(view[off:off + chunk])

    def recv(s: socket.socket, t: torch.Tensor) -> None:
        view = _bytes_view(t)
        got = 0
        while got < len(view):
            got += s.recv_into(view[got:], min(chunk, len(view) - got))

    times, cpu = [], []
    for _ in range(args.rounds + 1):
        barrier(socks, index)
        start, cpu_start = time.time(), time.process_time()
        threads = [threading.Thread(target=send, args=(socks[j], data[bounds[j]:bounds[j + 1]])) for j in socks]
        threads += [threading.Thread(target=recv, args=(socks[j], slots[j])) for j in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        acc = data[bounds[index]:bounds[index + 1]].clone()
        for j in socks:
            acc.add_(slots[j])
        acc.div_(n)
        threads = [threading.Thread(target=send, args=(socks[j], acc)) for j in socks]
        threads += [threading.Thread(target=recv, args=(socks[j], result[bounds[j]:bounds[j + 1]])) for j in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        result[bounds[index]:bounds[index + 1]].copy_(acc)
        data.copy_(result)
        times.append((start, time.time()))
        cpu.append(time.process_time() - cpu_start)
    print(json.dumps({"times": times[1:], "cpu": cpu[1:], "peak_mb": _peak_mb()}), flush=True)
    sys.stdin.readline()


def _bytes_view(t):
    import ctypes

    size = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * size).from_address(t.data_ptr())).cast("B")


def barrier(socks: dict[int, socket.socket], index: int) -> None:
    """Every peer tells every other it is ready, then waits for all of them."""
    for s in socks.values():
        s.sendall(b"R")
    for s in socks.values():
        assert s.recv(1, socket.MSG_WAITALL) == b"R"


# --------------------------------------------------------------------------------------------
# driver


def _default_sealing() -> str:
    from swarm.net import sealed

    return "worker threads (the default here)" if sealed.OFF_LOOP else "the loop's thread (the default here: <= 2 cores)"


def run_group(kind: str, n: int, args: argparse.Namespace, compression: int = 0, transport: str = "bulk",
              insecure: bool = False, pool: bool = True, seal: str = "") -> list[dict]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="33554432", MALLOC_TRIM_THRESHOLD_="1073741824",
               PYTHONPATH=ROOT)
    procs = []
    for i in range(n):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--index", str(i), "--n", str(n),
               "--mbytes", str(args.mbytes), "--rounds", str(args.rounds), "--compression", str(compression),
               "--transport", transport, *(["--insecure"] if insecure else []),
               *([] if pool else ["--no-pool"]), *(["--seal", seal] if seal else [])]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
    try:
        addrs = [json.loads(p.stdout.readline())["addr"] for p in procs]
        for p in procs:
            p.stdin.write(json.dumps({"addrs": addrs}) + "\n")
            p.stdin.flush()
        reports = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        for p in procs:
            p.wait(30)
        return reports
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def round_times(reports: list[dict]) -> list[float]:
    """Each round's time: from the moment the last peer called `step` to the last one's return."""
    rounds = min(len(r["times"]) for r in reports)
    return [max(r["times"][k][1] for r in reports) - max(r["times"][k][0] for r in reports) for k in range(rounds)]


def round_seconds(reports: list[dict]) -> float:
    for r in reports:
        for failure in r.get("failures", []):
            print(f"  (a round failed: {failure})", flush=True)
    return statistics.median(round_times(reports))


def repeated_figure(runs: list[list[dict]]) -> tuple[float, float, str]:
    """Median s/round over every round of every run, median CPU per peer per round, and each run's
    median (when there are several)."""
    seconds = statistics.median(t for reports in runs for t in round_times(reports))
    cpu = statistics.median(c for reports in runs for r in reports for c in r["cpu"])
    spread = "" if len(runs) == 1 else " (runs: " + ", ".join(f"{round_seconds(reports):.3f}" for reports in runs) + ")"
    return seconds, cpu, spread


def seal_open_cpu_per_mb(mb: int = 64) -> float:
    """CPU seconds to seal and then open 1 MB with the bulk channel's records (`swarm.net.sealed`,
    1 MiB records into reused buffers): what TLS adds per byte sent and received at the least."""
    from swarm.net import sealed

    key = sealed.derive_keys(os.urandom(sealed.RANDOM_BYTES), b"bench")[0]
    sealer, opener = sealed.Sealer(key), sealed.Opener(key)
    size = sealed.RECORD_BYTES
    plain = memoryview(bytearray(os.urandom(size)) * mb)  # tensors larger than the caches, as in a round
    out = memoryview(bytearray(len(plain)))
    out[:] = plain  # touched once: no page faults in the figure
    record = bytearray(size + 20)
    start = time.process_time()
    for i in range(mb):
        wire = sealer.seal(plain[i * size:(i + 1) * size], record)
        opener.open_into(bytes(wire[:4]), wire[4:], out[i * size:(i + 1) * size])
    return (time.process_time() - start) / (mb * size / 1e6)


def cpu_bound(n: int, mbytes: int, plain_s: float, plain_cpu: float, crypto_per_mb: float) -> str:
    """What the CPU allows: the cores the plaintext round keeps busy, and the best TLS/plaintext
    ratio if TLS only added its AES-GCM (each peer seals and opens 2(n-1)/n of its tensor's bytes:
    its parts out and back) and that had to fit into the cores the plaintext round leaves idle."""
    cores = os.cpu_count() or 1
    busy = n * plain_cpu / (cores * plain_s)
    crypto = crypto_per_mb * 2 * (n - 1) / n * mbytes * (1 << 20) / 1e6  # per peer per round
    best = plain_s / max(plain_s, n * (plain_cpu + crypto) / cores)
    return (f"plaintext keeps {100 * busy:.0f}% of {cores} cores busy; AES-GCM seal+open {crypto_per_mb * 1e3:.3f} ms/MB"
            f" = {crypto:.3f} s of CPU per peer per round: TLS at most {100 * best:.0f}% of plaintext"
            f" if its only extra were the cipher")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--mbytes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--worker", choices=["swarm", "raw"])
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--compression", type=int, default=0)
    parser.add_argument("--skip-fp16", action="store_true")
    parser.add_argument("--codecs", type=int, nargs="+", default=[1, 2],
                        help="the compressed wires run after float32, as CompressionType values (default: 1 2,"
                             " FLOAT16 and SCALED_FLOAT16; 3 is UNIFORM_8BIT)")
    parser.add_argument("--skip-grpc", action="store_true", help="skip the run with tensors over gRPC streams only")
    parser.add_argument("--transport", choices=["bulk", "grpc"], default="bulk", help=argparse.SUPPRESS)
    parser.add_argument("--insecure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-plaintext", action="store_true", help="skip the plaintext (--insecure) run")
    parser.add_argument("--no-pool", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compare-pool", action="store_true",
                        help="also run TLS and plaintext with a fresh bulk connection per stream (bulk_pool=False)")
    parser.add_argument("--seal", choices=["workers", "loop"], default="", help=argparse.SUPPRESS)
    parser.add_argument("--compare-inline", action="store_true",
                        help="also run TLS with every bulk record sealed and opened on the event loop's thread"
                             " (swarm.net.sealed.OFF_LOOP = False)")
    parser.add_argument("--compare-workers", action="store_true",
                        help="also run TLS with records of 64 KiB and more sealed and opened on worker threads"
                             " (swarm.net.sealed.OFF_LOOP = True)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the TLS, plaintext and --compare-inline groups this many times, alternating their"
                             " order; figures are medians over every round of every repetition")
    parser.add_argument("--plaintext-first", action="store_true", help="run the plaintext group before the TLS one")
    args = parser.parse_args()
    if args.worker == "swarm":
        return swarm_worker(args)
    if args.worker == "raw":
        return raw_worker(args)
    goals = {4: 0.4, 8: 0.8}
    crypto_per_mb = seal_open_cpu_per_mb()
    for n in args.peers:
        raw_reports = run_group("raw", n, args)
        raw = round_seconds(raw_reports)
        raw_cpu = statistics.median(c for r in raw_reports for c in r["cpu"])
        print(f"raw-socket butterfly  {n} peers, {args.mbytes} MB fp32: {raw:.3f} s/round (ceiling);"
              f" {raw_cpu:.3f} s of CPU per peer per round", flush=True)
        if not args.skip_grpc:
            grpc = round_seconds(run_group("swarm", n, args, transport="grpc"))  # TLS, like the default
            print(f"swarm over gRPC only  {n} peers, {args.mbytes} MB fp32: {grpc:.3f} s/round"
                  f" ({100 * raw / grpc:.0f}% of raw-socket ceiling)", flush=True)
        # TLS, plaintext and (--compare-inline) TLS with records sealed on the loop, each run
        # `--repeat` times in alternating order (the host is shared: a slow spell hits all of them)
        groups = {"tls": {}}
        if not args.skip_plaintext:
            groups["plain"] = {"insecure": True}
        if args.compare_inline:
            groups["inline"] = {"seal": "loop"}
        if args.compare_workers:
            groups["workers"] = {"seal": "workers"}
        names = list(groups)
        if args.plaintext_first and "plain" in names:
            names.remove("plain")
            names.insert(0, "plain")
        runs: dict[str, list[list[dict]]] = {name: [] for name in names}
        for repetition in range(args.repeat):
            for name in names if repetition % 2 == 0 else names[::-1]:
                runs[name].append(run_group("swarm", n, args, **groups[name]))

        reports = runs["tls"][-1]
        bulk, cpu, spread = repeated_figure(runs["tls"])
        goal = goals.get(n)
        print(f"swarm all-reduce      {n} peers, {args.mbytes} MB fp32: {bulk:.3f} s/round{spread}"
              f" ({100 * raw / bulk:.0f}% of raw-socket ceiling{f'; goal <= {goal} s' if goal else ''});"
              f" {cpu:.3f} s of CPU per peer per round; records sealed on {_default_sealing()}", flush=True)
        if "plain" in runs:
            plain, plain_cpu, spread = repeated_figure(runs["plain"])
            print(f"swarm all-reduce      {n} peers, {args.mbytes} MB fp32, plaintext (--insecure): {plain:.3f} s/round"
                  f"{spread}; {plain_cpu:.3f} s of CPU per peer per round", flush=True)
            print(f"TLS/plaintext         {n} peers: {100 * plain / bulk:.0f}% of plaintext throughput"
                  f" (goal >= 85%); CPU {cpu / plain_cpu:.2f}x", flush=True)
            print(f"CPU bound             {n} peers: {cpu_bound(n, args.mbytes, plain, plain_cpu, crypto_per_mb)}",
                  flush=True)
        for name, where in (("inline", "the loop's thread"), ("workers", "worker threads")):
            if name in runs:
                other, other_cpu, spread = repeated_figure(runs[name])
                print(f"swarm all-reduce      {n} peers, {args.mbytes} MB fp32, TLS with records sealed and opened on"
                      f" {where}: {other:.3f} s/round{spread}; {other_cpu:.3f} s of CPU per peer per round"
                      f"{f'; {100 * plain / other:.0f}% of plaintext' if 'plain' in runs else ''}", flush=True)
        if args.compare_pool:
            for insecure in (False, True):
                unpooled_reports = run_group("swarm", n, args, insecure=insecure, pool=False)
                unpooled = round_seconds(unpooled_reports)
                unpooled_cpu = statistics.median(c for r in unpooled_reports for c in r["cpu"])
                print(f"swarm all-reduce      {n} peers, {args.mbytes} MB fp32, {'plaintext' if insecure else 'TLS'}, "
                      f"a new bulk connection per stream (bulk_pool=False): {unpooled:.3f} s/round;"
                      f" {unpooled_cpu:.3f} s of CPU per peer per round", flush=True)
        peak = max(r["peak_mb"] for r in reports)
        base = max(r["baseline_mb"] for r in reports)
        tensor = reports[0]["tensor_mb"]
        print(f"swarm peak RSS        {n} peers: {peak:.0f} MB per peer = {peak / tensor:.2f}x the tensors "
              f"({(peak - base) / tensor:.2f}x above the {base:.0f} MB of a peer holding nothing)", flush=True)
        if not args.skip_fp16:
            from swarm.compression import CompressionType

            for codec in args.codecs:
                name = CompressionType(codec).name
                half_reports = run_group("swarm", n, args, compression=codec)
                half = round_seconds(half_reports)
                half_cpu = statistics.median(c for r in half_reports for c in r["cpu"])
                print(f"swarm all-reduce      {n} peers, {args.mbytes} MB, {name} on the wire: {half:.3f} s/round;"
                      f" {half_cpu:.3f} s of CPU per peer per round", flush=True)


if __name__ == "__main__":
    main()
