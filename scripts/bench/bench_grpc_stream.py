#!/usr/bin/env python
"""Benchmark: one grpc.aio client-streaming call moving `--mb` MB (no swarm layer), TLS 1.3 with a
swarm peer certificate against plaintext, for several message sizes and channel options, all in
one invocation (modes alternate). It separates what gRPC's TLS costs from what swarm's streaming
adds (`bench_rpc.py` measures the swarm stream).

    .venv/bin/python scripts/bench/bench_grpc_stream.py [--mb 256] [--repeats 2]
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

SINK = "/bench.Stream/Sink"
VARIANTS = {  # name -> (message KiB, extra channel and server options)
    "1 MiB messages": (1024, []),
    "64 KiB messages": (64, []),
    "4 MiB messages": (4096, []),
    "1 MiB, 16 MiB HTTP/2 frames": (1024, [("grpc.http2.max_frame_size", 16 << 20 - 1)]),
    "1 MiB, no BDP probe, 64 MiB window": (1024, [("grpc.http2.bdp_probe", 0),
                                                    ("grpc.http2.lookahead_bytes", 64 << 20)]),
}


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def serve(insecure: bool) -> None:
    import grpc

    from swarm.core.identity import Identity
    from swarm.net.tls import PeerCertificate

    async def sink(requests, context):
        total = 0
        async for message in requests:
            total += len(message)
        return json.dumps({"bytes": total, "cpu": _cpu()}).encode()

    async def main() -> None:
        identity = Identity.generate()
        options = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]
        for _, extra in VARIANTS.values():
            options += [o for o in extra if o[0] == "grpc.http2.max_frame_size"]
        server = grpc.aio.server(options=options)
        handler = grpc.stream_unary_rpc_method_handler(sink)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Stream", {"Sink": handler})])
        if insecure:
            port = server.add_insecure_port("127.0.0.1:0")
        else:
            cert = PeerCertificate.issue(identity)
            port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(cert.key_pem, cert.certificate_pem)]))
        await server.start()
        print(json.dumps({"port": port, "peer_id": identity.peer_id}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await server.stop(0)

    import uvloop

    uvloop.run(main())


def measure(info: dict, insecure: bool, mb: int, kib: int, extra: list) -> dict:
    import grpc
    import uvloop

    from swarm.net.tls import SERVER_NAME, trust_anchor

    message = os.urandom(kib << 10)
    count = max(1, (mb << 20) // len(message))

    async def main() -> dict:
        target = f"127.0.0.1:{info['port']}"
        options = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20), *extra]
        if insecure:
            channel = grpc.aio.insecure_channel(target, options=options)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates=trust_anchor(info["peer_id"]))
            channel = grpc.aio.secure_channel(target, credentials,
                                              options=[*options, ("grpc.ssl_target_name_override", SERVER_NAME)])
        call = channel.stream_unary(SINK)
        await call(iter([b"warm-up"]), timeout=30)
        server_cpu0 = json.loads(await call(iter([b""]), timeout=30))["cpu"]
        cpu0, t0 = _cpu(), time.perf_counter()
        done = json.loads(await call((message for _ in range(count)), timeout=300))
        elapsed, cpu = time.perf_counter() - t0, _cpu() - cpu0
        await channel.close()
        gb = count * len(message) / 1e9
        assert done["bytes"] == count * len(message)
        return {"gb_s": gb / elapsed, "sender_cpu_per_gb": cpu / gb, "receiver_cpu_per_gb": (done["cpu"] - server_cpu0) / gb}

    return uvloop.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--serve", choices=["tls", "plaintext"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve == "plaintext")
    modes = ["tls", "plaintext"]
    servers = {m: subprocess.Popen([sys.executable, __file__, "--serve", m], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True) for m in modes}
    try:
        infos = {m: json.loads(s.stdout.readline()) for m, s in servers.items()}  # type: ignore[union-attr]
        with open("/proc/loadavg") as f:
            print(f"load average at start: {f.read().split()[0]}")
        for name, (kib, extra) in VARIANTS.items():
            results: dict[str, list[dict]] = {m: [] for m in modes}
            for rep in range(args.repeats):
                for m in (modes if rep % 2 == 0 else modes[::-1]):
                    results[m].append(measure(infos[m], m == "plaintext", args.mb, kib, extra))
            line = []
            for m in modes:
                gb_s = statistics.median(r["gb_s"] for r in results[m])
                tx = statistics.median(r["sender_cpu_per_gb"] for r in results[m])
                rx = statistics.median(r["receiver_cpu_per_gb"] for r in results[m])
                line.append(f"{m} {gb_s:.3f} GB/s (CPU s/GB sender {tx:.2f}, receiver {rx:.2f})")
            tls = statistics.median(r["gb_s"] for r in results["tls"])
            plain = statistics.median(r["gb_s"] for r in results["plaintext"])
            print(f"{name:36s} {'; '.join(line)}; TLS {tls / plain:.0%} of plaintext", flush=True)
    finally:
        for s in servers.values():
            s.stdin.close()  # type: ignore[union-attr]
            s.wait(10)


if __name__ == "__main__":
    main()
