#!/usr/bin/env python
"""What metrics cost on the RPC hot path: this tree's metrics beside those of a baseline revision.

Both run in the same invocation, alternating, so machine load hits them alike:

  * per call: the metrics work of one RPC (bound `MethodMetrics`: `start`, payload bytes in and
    out, `finish`), timed in a loop, in a fresh process per implementation; and the same work done
    with prometheus_client's own `Counter`/`Gauge`/`Histogram` children (what swarm would cost if
    the hot path used them directly instead of plain numbers read by a collector at scrape time);
  * end to end: scripts/bench/bench_rpc.py (small unary round trip p50, calls per second with 200
    in flight) with the baseline's `swarm` package first on PYTHONPATH, then this tree's.

The share of the round trip spent on metrics is (per-call cost) / (round-trip p50).

Usage: .venv/bin/python scripts/bench/bench_metrics.py --baseline REV [--pairs 3] [--calls 2000]
(e.g. --baseline fbf864e, the last revision with the hand-written registry)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PER_CALL = """
from swarm.metrics.rpc import RPCMetrics
m = RPCMetrics("server").method("/swarm.Peer/Info")
def call():
    started = m.start()
    m.received.value += 120
    m.sent.value += 80
    m.finish(started, True)
"""

PROMETHEUS_CALL = """
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from swarm.metrics.registry import DEFAULT_BUCKETS
r = CollectorRegistry()
calls = Counter("c_total", "c", ("method", "outcome"), registry=r)
ok = calls.labels("/swarm.Peer/Info", "ok")
latency = Histogram("l_seconds", "l", ("method",), buckets=DEFAULT_BUCKETS, registry=r).labels("/swarm.Peer/Info")
received = Counter("r_total", "r", ("method",), registry=r).labels("/swarm.Peer/Info")
sent = Counter("s_total", "s", ("method",), registry=r).labels("/swarm.Peer/Info")
in_flight = Gauge("f", "f", registry=r)
import time
def call():
    in_flight.inc()
    started = time.perf_counter()
    received.inc(120)
    sent.inc(80)
    in_flight.dec()
    latency.observe(time.perf_counter() - started)
    ok.inc()
"""


def export_baseline(rev: str, into: Path) -> Path:
    """The `swarm` package as it was at `rev` (git archive), unpacked under `into`."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "swarm"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def per_call_ns(pythonpath: Path, number: int, setup: str = PER_CALL) -> float:
    code = (f"import timeit\nsetup = {setup!r}\n"
            f"t = min(timeit.repeat('call()', setup=setup, number={number}, repeat=5))\n"
            f"print(t / {number} * 1e9)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(pythonpath)}, cwd=pythonpath).stdout
    return float(out.strip())


def rpc(pythonpath: Path, calls: int) -> tuple[float, float]:
    """(round-trip p50 in ms, calls per second with 200 in flight) from bench_rpc.py."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_rpc.py"), "--mb", "8",
                          "--rounds", "1", "--starts", "1", "--calls", str(calls)],
                         capture_output=True, text=True, check=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(pythonpath)}, cwd=pythonpath).stdout
    p50 = float(re.search(r"unary RPC round trip p50: ([\d.]+) ms", out).group(1))
    rate = float(re.search(r"small calls with 200 in flight: ([\d,]+) /s", out).group(1).replace(",", ""))
    return p50, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision whose metrics to compare against")
    parser.add_argument("--pairs", type=int, default=3, help="baseline/current bench_rpc.py runs, alternating")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--number", type=int, default=200_000, help="loop iterations per per-call timing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"baseline": export_baseline(args.baseline, Path(tmp)), "current": ROOT}
        cost = {name: [per_call_ns(path, args.number) for _ in range(3)] for name, path in trees.items()}
        cost["prometheus_client types"] = [per_call_ns(ROOT, args.number, PROMETHEUS_CALL) for _ in range(3)]
        runs: dict[str, list[tuple[float, float]]] = {"baseline": [], "current": []}
        for _ in range(args.pairs):
            for name, path in trees.items():
                runs[name].append(rpc(path, args.calls))
    for name in trees:
        p50 = statistics.median(r[0] for r in runs[name])
        rate = statistics.median(r[1] for r in runs[name])
        ns = min(cost[name])
        print(f"{name:8}  metrics per call {ns:7.0f} ns   round trip p50 {p50:.3f} ms "
              f"(runs: {', '.join(f'{r[0]:.3f}' for r in runs[name])})   200 in flight {rate:,.0f} /s "
              f"(runs: {', '.join(f'{r[1]:,.0f}' for r in runs[name])})")
    print(f"prometheus_client types  metrics per call {min(cost['prometheus_client types']):7.0f} ns")
    extra_ns = min(cost["current"]) - min(cost["baseline"])
    p50_ns = statistics.median(r[0] for r in runs["current"]) * 1e6
    per_call_s = 1e9 / statistics.median(r[1] for r in runs["current"])
    print(f"metrics cost added per call: {extra_ns:.0f} ns = {extra_ns / p50_ns:.2%} of the round trip p50, "
          f"{extra_ns / per_call_s:.2%} of a call's share at 200 in flight (bar: 2%)")
    prom_ns = min(cost["prometheus_client types"]) - min(cost["baseline"])
    print(f"with prometheus_client types on the hot path instead: {prom_ns:.0f} ns = {prom_ns / p50_ns:.2%} of the "
          f"round trip p50, {prom_ns / per_call_s:.2%} at 200 in flight")


if __name__ == "__main__":
    main()
