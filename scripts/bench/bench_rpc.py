#!/usr/bin/env python
"""RPC benchmark (issue: foundation). One run reports, between two peer processes on loopback:

  * small unary RPC round trip, p50/p99 (authenticated, through swarm's channel pool, which sends
    small calls on one multiplexed gRPC stream per peer pair: swarm.net.calls), beside the same
    calls each sent as a gRPC unary call of its own, and a plain grpc.aio unary call to the same
    server with no swarm layer on either side; and calls per second with 200 in flight, both ways;
  * tensor streaming throughput for a 256 MB float32 tensor (header + 1 MiB raw chunks,
    received into a preallocated buffer), beside a raw uvloop TCP socket pair moving the
    same bytes in the same run (the ceiling);
  * peer start-up: launch of `python -m swarm` until its address line is printed;
  * a new connection: a fresh channel's connect (TCP, TLS handshake) and first call.

Everything above except the raw TCP ceiling runs twice in the same invocation: over TLS (the
default, docs/security.md) and plaintext (`--insecure` on both sides), to compare the two.

Usage: .venv/bin/python scripts/bench/bench_rpc.py [--mb 256] [--calls 2000] [--starts 5] [--modes tls,plaintext]
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

SINK = "/bench.Bench/Sink"
PING = "/bench.Bench/Ping"
RAW_PING = "/bench.Bench/RawPing"


def serve_peer(insecure: bool) -> None:
    from swarm.net.streaming import TensorReceiver
    from swarm.peer import Peer

    peer = Peer(listen="/ip4/127.0.0.1/tcp/0", insecure=insecure)

    async def ping(request: bytes, ctx):
        return request

    async def sink(requests, ctx):
        receiver = None
        async for message in requests:
            if receiver is None:
                receiver = TensorReceiver(message, max_bytes=4 << 30)
            else:
                receiver.feed(message)
        return str(receiver.total_bytes).encode()

    peer.server.add_unary(PING, ping)
    peer.server.add_unary(RAW_PING, ping, authenticated=False)
    peer.server.add_stream_unary(SINK, sink)
    print(peer.addrs[0], flush=True)
    sys.stdin.read()
    peer.shutdown()


def client_peer(addr: str, mb: int, calls: int, rounds: int, insecure: bool) -> None:
    import torch

    from swarm.net.streaming import tensors_to_messages
    from swarm.net.tls import SERVER_NAME, trust_anchor
    from swarm.peer import Peer

    peer = Peer(client_mode=True, insecure=insecure)
    tensor = torch.randn(mb * (1 << 20) // 4)

    async def go() -> dict:
        ch = peer.pool.get(addr)
        await ch.unary(PING, b"x")

        async def round_trips(call) -> list[float]:
            """Sorted round-trip times of `calls` calls, after 200 to warm up."""
            for _ in range(200):
                await call()
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                await call()
                times.append(time.perf_counter() - t0)
            return sorted(times)

        lat = await round_trips(lambda: ch.unary(PING, b"x" * 32))

        async def concurrent(total: int = 10_000, in_flight: int = 200) -> float:
            limit = asyncio.Semaphore(in_flight)

            async def one() -> None:
                async with limit:
                    await ch.unary(PING, b"x" * 32)

            t0 = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(total)))
            return total / (time.perf_counter() - t0)

        rate = await concurrent()
        ch.calls_supported = False  # the same calls, each as a gRPC unary call of its own
        own_rate = await concurrent()
        own_lat = await round_trips(lambda: ch.unary(PING, b"x" * 32))
        ch.calls_supported = True
        import grpc

        if insecure:
            raw = grpc.aio.insecure_channel(ch.addr.grpc_target)
        else:  # the same TLS a swarm channel uses, without the swarm layer
            raw = grpc.aio.secure_channel(ch.addr.grpc_target,
                                          grpc.ssl_channel_credentials(root_certificates=trust_anchor(ch.peer_id)),
                                          options=[("grpc.ssl_target_name_override", SERVER_NAME)])
        raw_ping = raw.unary_unary(RAW_PING)
        raw_lat = await round_trips(lambda: raw_ping(b"x" * 32, timeout=10))
        await raw.close()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await ch.stream_unary(SINK, tensors_to_messages([tensor]), timeout=120)
            times.append(time.perf_counter() - t0)
        connects = []
        for _ in range(50):  # a fresh channel each time: TCP connect, TLS handshake, first call
            await peer.pool.forget(ch.peer_id)
            t0 = time.perf_counter()
            await peer.pool.get(addr).unary(PING, b"x")
            connects.append(time.perf_counter() - t0)
        return {"connect_ms": statistics.median(connects) * 1e3,"p50_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
                "raw_p50_ms": raw_lat[len(raw_lat) // 2] * 1e3, "own_p50_ms": own_lat[len(own_lat) // 2] * 1e3,
                "rate": rate, "own_rate": own_rate,
                "stream_s": statistics.median(times)}

    print(json.dumps(peer.run(go())), flush=True)
    peer.shutdown()


def raw_server() -> None:
    import uvloop

    async def main() -> None:
        done = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            header = await reader.readexactly(8)
            left = int.from_bytes(header, "big")
            buf = bytearray(left)
            view = memoryview(buf)
            pos = 0
            while pos < left:
                chunk = await reader.read(min(1 << 20, left - pos))
                if not chunk:
                    break
                view[pos:pos + len(chunk)] = chunk
                pos += len(chunk)
            writer.write(b"k")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        done.set()
        server.close()

    uvloop.run(main())


def raw_client(port: int, mb: int, rounds: int) -> None:
    import torch
    import uvloop

    data = torch.randn(mb * (1 << 20) // 4).numpy().view("uint8")

    async def main() -> float:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(len(data).to_bytes(8, "big"))
            view = memoryview(data)
            for off in range(0, len(data), 1 << 20):
                writer.write(view[off:off + (1 << 20)])
                await writer.drain()
            await reader.readexactly(1)
            writer.close()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    print(json.dumps({"stream_s": uvloop.run(main())}), flush=True)


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def measure_startup(starts: int, insecure: bool) -> list[float]:
    times = []
    for _ in range(starts):
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "swarm", "--listen", "/ip4/127.0.0.1/tcp/0",
                                 "--log-level", "ERROR", *(["--insecure"] if insecure else [])],
                                stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        times.append(time.perf_counter() - t0)
        assert line.startswith("/ip4/"), line
        proc.terminate()
        proc.wait(10)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="main")
    parser.add_argument("--addr")
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--insecure", action="store_true", help="(server/client roles) plaintext")
    parser.add_argument("--modes", default="tls,plaintext", help="which transports to measure, in order")
    args = parser.parse_args()
    if args.role == "server":
        return serve_peer(args.insecure)
    if args.role == "client":
        return client_peer(args.addr, args.mb, args.calls, args.rounds, args.insecure)
    if args.role == "raw-server":
        return raw_server()
    if args.role == "raw-client":
        return raw_client(int(args.addr), args.mb, args.rounds)

    results = {}
    for mode in args.modes.split(","):
        flag = ["--insecure"] if mode == "plaintext" else []
        server = spawn("--role", "server", *flag)
        addr = server.stdout.readline().strip()
        client = spawn("--role", "client", "--addr", addr, "--mb", str(args.mb), "--calls", str(args.calls),
                       "--rounds", str(args.rounds), *flag)
        results[mode] = json.loads(client.stdout.readline())
        client.wait()
        server.stdin.close()
        server.wait()
        results[mode]["startup"] = measure_startup(args.starts, mode == "plaintext")

    raw = spawn("--role", "raw-server")
    port = raw.stdout.readline().strip()
    raw_client_proc = spawn("--role", "raw-client", "--addr", port, "--mb", str(args.mb), "--rounds", str(args.rounds))
    raw_result = json.loads(raw_client_proc.stdout.readline())
    raw_client_proc.wait()
    raw.stdin.close()
    raw.wait()

    nbytes = args.mb * (1 << 20)
    raw_gbs = nbytes / raw_result["stream_s"] / 1e9
    print(f"stream {args.mb} MB, raw uvloop TCP, plaintext (ceiling): {raw_gbs:.2f} GB/s ({raw_result['stream_s']:.3f} s)")
    for mode, grpc_result in results.items():
        startup = grpc_result["startup"]
        grpc_gbs = nbytes / grpc_result["stream_s"] / 1e9
        print(f"[{mode}] unary RPC round trip p50: {grpc_result['p50_ms']:.3f} ms (goal <= 0.5 ms; TLS <= 0.6 ms)")
        print(f"[{mode}] unary RPC round trip p99: {grpc_result['p99_ms']:.3f} ms")
        print(f"[{mode}] swarm unary call sent as a gRPC unary call of its own p50 (baseline): "
              f"{grpc_result['own_p50_ms']:.3f} ms")
        print(f"[{mode}] plain grpc.aio unary p50, no swarm layer (baseline): {grpc_result['raw_p50_ms']:.3f} ms")
        print(f"[{mode}] small calls with 200 in flight: {grpc_result['rate']:,.0f} /s; as gRPC unary calls of "
              f"their own (baseline): {grpc_result['own_rate']:,.0f} /s")
        print(f"[{mode}] new channel (connect, handshake, first call) median: {grpc_result['connect_ms']:.2f} ms")
        print(f"[{mode}] stream {args.mb} MB float32, swarm/grpc: {grpc_gbs:.2f} GB/s ({grpc_result['stream_s']:.3f} s);"
              f" {grpc_gbs / raw_gbs:.0%} of raw TCP (goal >= 60%)")
        print(f"[{mode}] peer start-up to addresses printed: median {statistics.median(startup):.2f} s, "
              f"max {max(startup):.2f} s over {len(startup)} starts (goal <= 1.5 s)")
    if "tls" in results and "plaintext" in results:
        tls_r, plain_r = results["tls"], results["plaintext"]
        print(f"TLS/plaintext: small-call p50 {tls_r['p50_ms'] / plain_r['p50_ms']:.2f}x, stream throughput "
              f"{plain_r['stream_s'] / tls_r['stream_s']:.0%}, new channel {tls_r['connect_ms'] / plain_r['connect_ms']:.2f}x")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
