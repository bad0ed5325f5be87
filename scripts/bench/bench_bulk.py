#!/usr/bin/env python
"""Benchmark: one bulk side-channel stream (`swarm.net.bulk`) between two processes on loopback,
TLS (the default) against plaintext, alternating the modes in one invocation.

The callee runs a real `BulkListener` whose handler consumes every request frame and answers with
one small frame; the caller opens the stream with `bulk.connect` + `bulk.exchange` and sends
`--mb` MB in `--frame-kb` KiB frames. Prints, per mode and repetition, the caller's throughput and
the CPU seconds both processes spent per GB moved, then the median TLS/plaintext ratios.

    .venv/bin/python scripts/bench/bench_bulk.py [--mb 512] [--frame-kb 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

METHOD = "/bench.Bulk/Sink"


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def serve(insecure: bool) -> None:
    import uvloop

    from swarm.core.identity import Identity
    from swarm.net.bulk import BulkListener
    from swarm.net.tls import PeerCertificate, server_context

    async def sink(requests, ctx):
        total = 0
        async for message in requests:
            total += len(message)
        yield json.dumps({"bytes": total, "cpu": _cpu()}).encode()

    async def main() -> None:
        identity = Identity.generate()
        listener = BulkListener({METHOD: sink}, lambda caller, deadline, conn: None, max_frame_bytes=16 << 20)
        context = None if insecure else server_context(PeerCertificate.issue(identity))
        port = await listener.start("127.0.0.1", 0, context)
        print(json.dumps({"port": port, "peer_id": identity.peer_id}), flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            token = listener.issue("caller", METHOD, 600.0)
            print(json.dumps({"token": token.hex(), "cpu": _cpu()}), flush=True)
        await listener.stop()

    uvloop.run(main())


def run_client(server: subprocess.Popen, info: dict, insecure: bool, mb: int, frame_kb: int) -> dict:
    import uvloop

    from swarm.net import bulk

    payload = os.urandom(frame_kb << 10)
    frames = max(1, (mb << 20) // len(payload))
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write("token\n")
    server.stdin.flush()
    answer = json.loads(server.stdout.readline())

    async def main() -> dict:
        loop = asyncio.get_running_loop()
        cpu0, t0 = _cpu(), time.perf_counter()
        conn = await bulk.connect("127.0.0.1", info["port"], bytes.fromhex(answer["token"]), 5.0, 16 << 20,
                                  info["peer_id"], tls=not insecure)
        responses = [bytes(r) async for r in bulk.exchange(conn, (payload for _ in range(frames)),
                                                           loop.time() + 600, info["peer_id"], METHOD)]
        elapsed, cpu = time.perf_counter() - t0, _cpu() - cpu0
        done = json.loads(responses[0])
        assert done["bytes"] == frames * len(payload), done
        gb = frames * len(payload) / 1e9
        return {"gb_s": gb / elapsed, "cpu_per_gb": (cpu + done["cpu"] - answer["cpu"]) / gb,
                "sender_cpu_per_gb": cpu / gb, "receiver_cpu_per_gb": (done["cpu"] - answer["cpu"]) / gb}

    return uvloop.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--frame-kb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="tls,plaintext")
    parser.add_argument("--serve", choices=["tls", "plaintext"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve == "plaintext")
    modes = args.modes.split(",")
    servers = {m: subprocess.Popen([sys.executable, __file__, "--serve", m], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True) for m in modes}
    try:
        infos = {m: json.loads(s.stdout.readline()) for m, s in servers.items()}  # type: ignore[union-attr]
        results: dict[str, list[dict]] = {m: [] for m in modes}
        with open("/proc/loadavg") as f:
            print(f"load average at start: {f.read().split()[0]}")
        for rep in range(args.repeats):
            for m in (modes if rep % 2 == 0 else modes[::-1]):
                r = run_client(servers[m], infos[m], m == "plaintext", args.mb, args.frame_kb)
                results[m].append(r)
                print(f"{m:9s} rep {rep}: {r['gb_s']:.3f} GB/s, {r['cpu_per_gb']:.2f} CPU s/GB "
                      f"(sender {r['sender_cpu_per_gb']:.2f}, receiver {r['receiver_cpu_per_gb']:.2f})",
                      flush=True)
        if "tls" in results and "plaintext" in results:
            tls = statistics.median(r["gb_s"] for r in results["tls"])
            plain = statistics.median(r["gb_s"] for r in results["plaintext"])
            cpu_t = statistics.median(r["cpu_per_gb"] for r in results["tls"])
            cpu_p = statistics.median(r["cpu_per_gb"] for r in results["plaintext"])
            print(f"median: TLS {tls:.3f} GB/s, plaintext {plain:.3f} GB/s: TLS {tls / plain:.0%} of plaintext, "
                  f"{cpu_t / cpu_p:.2f}x the CPU per GB")
    finally:
        for s in servers.values():
            s.stdin.close()  # type: ignore[union-attr]
            s.wait(10)


if __name__ == "__main__":
    main()
