"""Small network probes the lab runs on its hosts to measure its links: UDP round trips and TCP
throughput. Each prints one JSON line (servers first print `ready`).

    python -m swarm.testing.probe echo IP PORT              # UDP echo server
    python -m swarm.testing.probe rtt IP PORT COUNT GAP_S [TIMEOUT_S]  # round trips to an echo server
    python -m swarm.testing.probe sink IP PORT              # TCP server: counts what one client sends
    python -m swarm.testing.probe source IP PORT SECONDS    # TCP client: sends as fast as it can
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time


def echo(ip: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((ip, port))
        print("ready", flush=True)
        s.settimeout(120)
        while True:
            try:
                data, addr = s.recvfrom(2048)
            except TimeoutError:
                return
            if data == b"stop":
                return
            s.sendto(data, addr)


def rtt(ip: str, port: int, count: int, gap: float, timeout: float = 2.0) -> dict[str, object]:
    samples: list[float] = []
    lost = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        for i in range(count):
            tag = i.to_bytes(4, "big")
            sent = time.perf_counter()
            s.sendto(tag + b"x" * 60, (ip, port))
            try:
                while True:
                    data, _ = s.recvfrom(2048)
                    if data[:4] == tag:
                        samples.append(time.perf_counter() - sent)
                        break
            except TimeoutError:
                lost += 1
            time.sleep(gap)
        s.sendto(b"stop", (ip, port))
    samples.sort()
    return {"count": count, "lost": lost, "p50_ms": 1000 * statistics.median(samples) if samples else None,
            "mean_ms": 1000 * statistics.fmean(samples) if samples else None,
            "p10_ms": 1000 * samples[len(samples) // 10] if samples else None,
            "p90_ms": 1000 * samples[len(samples) * 9 // 10] if samples else None,
            "stdev_ms": 1000 * statistics.pstdev(samples) if samples else None}


def sink(ip: str, port: int) -> dict[str, object]:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((ip, port))
        server.listen(1)
        print("ready", flush=True)
        server.settimeout(60)
        conn, _ = server.accept()
        total = 0
        first = last = None
        with conn:
            conn.settimeout(60)
            buf = bytearray(1 << 20)
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                now = time.perf_counter()
                first = first or now
                last = now
                total += n
    seconds = (last - first) if first and last else 0.0
    return {"bytes": total, "seconds": seconds, "mbit_per_s": total * 8 / seconds / 1e6 if seconds else None}


def source(ip: str, port: int, seconds: float) -> dict[str, object]:
    chunk = os.urandom(1 << 16)
    sent = 0
    with socket.create_connection((ip, port), timeout=30) as s:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            s.sendall(chunk)
            sent += len(chunk)
    return {"bytes": sent}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "echo":
        echo(args[0], int(args[1]))
        return 0
    if cmd == "rtt":
        result = rtt(args[0], int(args[1]), int(args[2]), float(args[3]), *(float(a) for a in args[4:5]))
    elif cmd == "sink":
        result = sink(args[0], int(args[1]))
    elif cmd == "source":
        result = source(args[0], int(args[1]), float(args[2]))
    else:
        print(f"unknown probe {cmd!r}\n{__doc__}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
