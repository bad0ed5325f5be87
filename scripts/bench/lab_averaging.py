#!/usr/bin/env python
"""Scenario 3 of the network lab: bandwidth-bound averaging. `--peers` peers, each on its own lab
host with a `--mbit` link each way and `--delay-ms` one way (50 ms round trip between two hosts
by default), average `--mbytes` MB with swarm's butterfly all-reduce, in fp32 and fp16 on the
wire. The link bound of a round is the bytes each peer must send (2 (n-1)/n of the tensor: its
share of reduce-scatter, then of all-gather) over the link rate; the figure is bound / round time.
In the same lab and run, a plain-TCP butterfly moving the same bytes shows what the links give.

    .venv/bin/python scripts/bench/lab_averaging.py [--peers 4 8] [--mbytes 100] [--rounds 3]

A round's time is from the moment the last peer called `step` to the moment the last peer
returned (as in scripts/bench/bench_averaging.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def worker(args: argparse.Namespace) -> None:
    import torch

    from swarm.averaging import AllReduceConfig, Averager, AveragerConfig
    from swarm.net import bulk
    from swarm.peer import Peer

    torch.set_num_threads(1)
    import logging
    if args.diag:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                            format=f"%(created).3f h{args.index} %(name)s %(message)s")
        logging.getLogger("swarm.averaging").setLevel(logging.DEBUG)
        logging.getLogger("swarm.net").setLevel(logging.DEBUG)
    from swarm.net.channels import ChannelConfig

    if args.lowat >= 0:
        bulk.NOTSENT_LOWAT = args.lowat
    if args.no_hold:
        from swarm.averaging import reducer
        reducer.LEADER_HOLD_CAP = 0.0
    peer = Peer(listen=f"/ip4/{args.address}/tcp/0", channel_config=ChannelConfig(bulk_pool=not args.no_pool),
                insecure=args.insecure)
    print(json.dumps({"addr": peer.addrs[0]}), flush=True)
    addrs = json.loads(sys.stdin.readline())["addrs"]
    numel = args.mbytes * 1_000_000 // 4
    tensors = [torch.full((numel,), float(args.index))]
    avg = Averager(peer, tensors, initial_group=addrs, target_group_size=len(addrs), min_group_size=len(addrs),
                   config=AveragerConfig(compression=args.compression, allreduce=AllReduceConfig(
                       **({} if args.lockstep < 0 else {"lockstep": args.lockstep}))))
    times, failures = [], []
    usage = None
    for r in range(args.rounds + 1):
        if r == 1:
            usage = resource.getrusage(resource.RUSAGE_SELF)
        start = time.time()
        if args.diag:
            logging.getLogger("lab").warning("step called")
        try:
            avg.step(timeout=300)
        except Exception as e:  # noqa: BLE001 - reported, the benchmark goes on
            failures.append(f"{type(e).__name__}: {e}")
            continue
        times.append((start, time.time()))
    print(json.dumps({"times": times[1:], "failures": failures, "cpu": _cpu(usage, args.rounds)}), flush=True)
    sys.stdin.readline()
    peer.shutdown()


def _cpu(before: resource.struct_rusage | None, rounds: int) -> tuple[float, float, float]:
    """This process's user and system CPU seconds and minor page faults per measured round (the
    rounds after the warm-up: `before` is the usage when the first of them started)."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    if before is None or rounds < 1:
        return float("nan"), float("nan"), float("nan")
    return ((now.ru_utime - before.ru_utime) / rounds, (now.ru_stime - before.ru_stime) / rounds,
            (now.ru_minflt - before.ru_minflt) / rounds)


def raw_worker(args: argparse.Namespace) -> None:
    """The same butterfly over plain TCP (one connection per pair, a thread per direction): what
    the lab's links give when nothing but the transfer runs."""
    index = args.index
    listener = socket.create_server((args.address, 0))
    print(json.dumps({"addr": f"{args.address}:{listener.getsockname()[1]}"}), flush=True)
    addrs = json.loads(sys.stdin.readline())["addrs"]
    n = len(addrs)
    part = args.mbytes * 1_000_000 // n // (2 if args.compression else 1)
    socks: dict[int, socket.socket] = {}
    for j in range(index + 1, n):  # lower index dials higher index
        host, port = addrs[j].rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
        s.sendall(index.to_bytes(4, "little"))
        socks[j] = s
    for _ in range(index):
        s, _ = listener.accept()
        socks[int.from_bytes(s.recv(4, socket.MSG_WAITALL), "little")] = s
    payload = memoryview(bytearray(part))

    def send(s: socket.socket) -> None:
        for off in range(0, part, 1 << 20):
            s.sendall(payload[off:off + (1 << 20)])

    def recv(s: socket.socket) -> None:
        buf = memoryview(bytearray(1 << 20))
        got = 0
        while got < part:
            got += s.recv_into(buf, min(1 << 20, part - got))

    times = []
    usage = None
    for r in range(args.rounds + 1):
        if r == 1:
            usage = resource.getrusage(resource.RUSAGE_SELF)
        for s in socks.values():  # a barrier: every peer is ready
            s.sendall(b"R")
        for s in socks.values():
            s.recv(1, socket.MSG_WAITALL)
        start = time.time()
        for _phase in ("reduce-scatter", "all-gather"):
            threads = [threading.Thread(target=f, args=(s,)) for s in socks.values() for f in (send, recv)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        times.append((start, time.time()))
    print(json.dumps({"times": times[1:], "failures": [], "cpu": _cpu(usage, args.rounds)}), flush=True)
    sys.stdin.readline()


def sample_sockets(lab, n: int, path: str, stop: threading.Event) -> None:
    """Writes `ss -tin` of every host once a second (cwnd, rtt, send/receive windows) to `path`."""
    with open(path, "w") as out:
        while not stop.wait(1.0):
            for i in range(n):
                result = lab.exec(f"h{i}", ["ss", "-tinm", "state", "established"], timeout=5)
                out.write(f"== {time.time():.3f} h{i}\n{result.stdout}")
            out.flush()


# swarm's variants beside the default: (name, worker arguments)
VARIANTS = {
    "swarm": [],
    "swarm-nolowat": ["--lowat", "0"],                                   # lockstep without the small queue
    "swarm-nohold": ["--no-hold"],                                       # the leader's mean sent at once (before)
    "swarm-nopool": ["--no-pool"],                                       # --compare-pool
    "swarm-lowat": ["--lockstep", "0"],                                  # --compare-lockstep
    "swarm-free": ["--lockstep", "0", "--lowat", "0"],                   # --compare-lockstep: the code before
    "swarm-insecure": ["--insecure"],                                    # --compare-insecure
}


def variant_arguments(variant: str) -> list[str]:
    """A swarm variant's worker arguments: one of `VARIANTS`, or `swarm-lockstepN` (lockstep N)."""
    if variant.startswith("swarm-lockstep") and variant[len("swarm-lockstep"):].isdigit():
        return ["--lockstep", variant[len("swarm-lockstep"):]]
    return VARIANTS[variant]


def run_group(lab, n: int, args: argparse.Namespace, compression: int, raw: bool = False,
              variant: str = "swarm", name: str = "") -> list[dict]:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}
    procs = []
    for i in range(n):
        host = f"h{i}"
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--index", str(i), "--address",
                lab.address(host), "--mbytes", str(args.mbytes), "--rounds", str(args.rounds),
                "--compression", str(compression), *(["--raw"] if raw else []), *(["--diag", args.diag] if args.diag else []),
                *([] if raw else variant_arguments(variant))]
        kind = name or ("raw" if raw else variant)  # the --diag files' name
        log = os.path.join(args.diag, f"{n}-{compression}-{kind}-h{i}.log") if args.diag else ""
        with open(log or os.devnull, "wb") as stderr:  # the child keeps its own descriptor
            procs.append(lab.spawn(host, argv, stdin=subprocess.PIPE, env=env, stderr=stderr if log else None))
    stop = threading.Event()
    if args.diag:
        threading.Thread(target=sample_sockets, daemon=True, args=(
            lab, n, os.path.join(args.diag, f"{n}-{compression}-{kind}-ss.txt"), stop)).start()
    try:
        addrs = [json.loads(p.stdout.readline())["addr"] for p in procs]
        for p in procs:
            p.stdin.write((json.dumps({"addrs": addrs}) + "\n").encode())
            p.stdin.flush()
        reports = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            p.stdin.write(b"\n")
            p.stdin.flush()
        for p in procs:
            p.wait(60)
        return reports
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()


_POINT = re.compile(r"^(?P<t>\d+\.\d+) h(?P<h>\d+) \S+ (?P<msg>.*)$")
_PHASES = [  # (label, regex on the message, first or last occurrence in the round)
    ("step", r"^step called$", "last"),
    ("send start", r"part \d+: sending to its reducer", "first"),
    ("send end", r"part \d+: sent to its reducer", "last"),
    ("1st sender in", r"part \d+: sender \d+ complete", "first"),
    ("senders in", r"part \d+: sender \d+ complete", "last"),
    ("report", r"part \d+: reporting after", "first"),
    ("decided", r"part \d+: decided after", "first"),
    ("result out", r"part \d+: result to sender \d+ starts", "first"),
    ("1st result in", r"part \d+: first result chunk in", "first"),
    ("result out end", r"part \d+: result to sender \d+ queued", "last"),
    ("1st part in", r"part \d+: last result chunk in", "first"),
    ("all in", r"all parts in after", "first"),
    ("applied", r"applied after", "first"),
]


def timeline(paths: list[str]) -> str:
    """Per peer, when each phase of its last round began or ended (seconds after the last peer
    called `step`), from the `--diag` logs: where the round's time goes."""
    points: list[dict[str, float]] = []
    for path in paths:
        with open(path, errors="replace") as f:
            lines = [m for m in map(_POINT.match, f) if m]
        steps = [i for i, m in enumerate(lines) if m["msg"] == "step called"]
        lines = lines[steps[-1]:] if steps else lines
        mine: dict[str, float] = {}
        for label, pattern, which in _PHASES:
            times = [float(m["t"]) for m in lines if re.search(pattern, m["msg"])]
            if times:
                mine[label] = times[0] if which == "first" else times[-1]
        points.append(mine)
    origin = max((p["step"] for p in points if "step" in p), default=0.0)
    rows = ["    " + "".join(f"{label:>15}" for label, _, _ in _PHASES)]
    for i, mine in enumerate(points):
        rows.append(f"  h{i} " + "".join(f"{mine[label] - origin:15.3f}" if label in mine else f"{'-':>15}"
                                         for label, _, _ in _PHASES))
    return "\n".join(rows)


def round_seconds(reports: list[dict]) -> list[float]:
    for r in reports:
        for failure in r.get("failures", []):
            print(f"  (a round failed: {failure})", flush=True)
    rounds = min(len(r["times"]) for r in reports)
    return [max(r["times"][k][1] for r in reports) - max(r["times"][k][0] for r in reports) for k in range(rounds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--mbytes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=12.5)
    parser.add_argument("--wire", nargs="+", default=["fp32", "fp16"], choices=["fp32", "fp16"])
    parser.add_argument("--only", choices=["raw", "swarm"], default=None, help="run only one of the two")
    parser.add_argument("--compare-pool", action="store_true",
                        help="also run swarm with a fresh bulk connection per stream (bulk_pool=False, the baseline)")
    parser.add_argument("--compare-lockstep", action="store_true",
                        help="also run swarm without lockstep (AllReduceConfig.lockstep=0) and without it and the bulk "
                             "connections' small send queue (swarm.net.bulk.NOTSENT_LOWAT=0: the code before)")
    parser.add_argument("--no-pool", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compare-insecure", action="store_true",
                        help="also run swarm with every peer --insecure (plaintext: what TLS costs on these links)")
    parser.add_argument("--insecure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lockstep", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--lowat", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--no-hold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variants", nargs="+", default=None,
                        help="swarm's variants to run instead of the default set: " + ", ".join(VARIANTS)
                             + ", or swarm-lockstepN (lockstep N chunks)")
    parser.add_argument("--congestion", default="",
                        help="TCP congestion control on every lab host (e.g. reno, loss-based like most hosts' cubic, which "
                             "this machine does not allow in namespaces; default: the host's, "
                             "inherited by the namespaces: bbr on this machine)")
    parser.add_argument("--slow-start-after-idle", type=int, choices=(0, 1), default=None,
                        help="set net.ipv4.tcp_slow_start_after_idle on every lab host (default: the host's, 1 on "
                             "Linux: a connection idle for a retransmission timeout starts its window again)")
    parser.add_argument("--min-tso-segs", type=int, default=None,
                        help="set net.ipv4.tcp_min_tso_segs on every lab host (default: the kernel's 2): the fewest "
                             "segments TCP puts in one GSO packet, which the relay handles as one")
    parser.add_argument("--relay-normal", action="store_true",
                        help="run the lab's delay relay as a normal process, not in the real-time class (the lab's "
                             "default before 2026-12-03), to compare")
    parser.add_argument("--diag", default="", help="a folder: per-peer debug logs and `ss -tin` samples go there")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    parser.add_argument("--compression", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return raw_worker(args) if args.raw else worker(args)

    from swarm.testing import HostSpec, Lab, LinkProfile

    if args.diag:
        os.makedirs(args.diag, exist_ok=True)

    link = LinkProfile(up_mbit=args.mbit, down_mbit=args.mbit, delay_ms=args.delay_ms)
    print(f"lab averaging: {args.mbytes} MB per peer, every host {args.mbit:g} Mbit/s each way, "
          f"{4 * args.delay_ms:g} ms round trip between hosts; {args.rounds} rounds after one warm-up", flush=True)
    for n in args.peers:
        with Lab([HostSpec(f"h{i}", link) for i in range(n)], seed=1, realtime_relay=not args.relay_normal) as lab:
            for key, value in (("tcp_congestion_control", args.congestion),
                               ("tcp_slow_start_after_idle", args.slow_start_after_idle),
                               ("tcp_min_tso_segs", args.min_tso_segs)):
                if value not in (None, ""):
                    set_on_hosts(lab, n, f"net.ipv4.{key}", value)
            used = lab.exec("h0", ["sysctl", "-n", "net.ipv4.tcp_congestion_control"]).stdout.strip()
            print(f"  {n} peers: TCP congestion control {used}", flush=True)
            variants = args.variants or ["swarm", *(["swarm-nopool"] if args.compare_pool else []),
                                         *(["swarm-lowat", "swarm-free"] if args.compare_lockstep else []),
                                         *(["swarm-insecure"] if args.compare_insecure else [])]
            runs = [(c, wire, raw, v) for c, wire in ((0, "fp32"), (1, "fp16"))
                    for raw, v in ((True, "raw"), *((False, v) for v in variants))]
            seen: dict[tuple[int, str], int] = {}
            for compression, wire, raw, variant in runs:
                if wire not in args.wire or (args.only and args.only != ("raw" if raw else "swarm")):
                    continue
                kind = "raw" if raw else variant
                seen[compression, kind] = seen.get((compression, kind), 0) + 1
                name = kind if seen[compression, kind] == 1 else f"{kind}.{seen[compression, kind]}"  # --diag files
                before = lab.relay_stats()
                t0, seen0 = before["cpu_seconds"], _packets(before)
                w0 = time.monotonic()
                reports = run_group(lab, n, args, compression, raw, variant, name)
                times = round_seconds(reports)
                cpu = [r.get("cpu", (math.nan,) * 3) for r in reports]
                relay = lab.relay_stats()
                relay_cpu = (relay["cpu_seconds"] - t0) / (time.monotonic() - w0)
                packets = (_packets(relay) - seen0) / (time.monotonic() - w0)
                sent = 2 * (n - 1) / n * args.mbytes * 1e6 / (2 if compression else 1)
                bound = sent * 8 / (args.mbit * 1e6)
                median = statistics.median(times) if times else float("nan")
                who = "raw TCP butterfly" if raw else {"swarm": "swarm averager", "swarm-nopool": "swarm, no pool",
                                                       "swarm-lowat": "swarm, no lockstep",
                                                       "swarm-free": "swarm, neither (before)",
                                                       "swarm-nolowat": "swarm, no small send queue",
                                                       "swarm-insecure": "swarm, plaintext",
                                                       "swarm-nohold": "swarm, the leader's mean at once (before)"}.get(
                                                           variant, variant.replace("swarm-lockstep", "swarm, lockstep "))
                print(f"  {n} peers {wire} {who}: round {median:6.2f} s (rounds {', '.join(f'{t:.2f}' for t in times)}); "
                      f"link bound {bound:5.2f} s ({sent / 1e6:.0f} MB sent per peer) -> {100 * bound / median:3.0f}% "
                      f"of the bound; relay CPU {100 * relay_cpu:.0f}% of a core, {packets / 1e3:.1f}k packets/s, "
                      f"{'real-time' if relay['realtime'] else 'normal'}, lag so far mean {relay['late_ms_mean']:.2f} "
                      f"max {relay['late_ms_max']:.1f} ms; per peer per round (medians): CPU user "
                      f"{statistics.median(c[0] for c in cpu):.2f} s, system {statistics.median(c[1] for c in cpu):.2f} s, "
                      f"{statistics.median(c[2] for c in cpu) / 1e3:.0f}k minor page faults",
                      flush=True)
                if args.diag and not raw:
                    print(timeline([os.path.join(args.diag, f"{n}-{compression}-{name}-h{i}.log") for i in range(n)]),
                          flush=True)


def set_on_hosts(lab: Any, n: int, key: str, value: object) -> None:
    """Sets a sysctl on every lab host (its network namespace's own copy) and says so."""
    for i in range(n):
        done = lab.exec(f"h{i}", ["sysctl", "-qw", f"{key}={value}"])
        if done.returncode != 0:
            raise SystemExit(f"cannot set {key}={value} on h{i}: {done.stderr.strip()}")
    print(f"  {n} peers: {key.rsplit('.', 1)[-1]} {value}", flush=True)


def _packets(stats: dict) -> int:
    """Packets the relay has taken in so far, all queues."""
    return sum(q["seen"] for queues in stats["queues"].values() for q in queues.values())


if __name__ == "__main__":
    main()
