#!/usr/bin/env python
"""How faithful the network lab's links are: for each profile, the round trip asked for against
the UDP round trip measured (p10/p50/p90, 200 probes), the bandwidth asked for against the TCP
goodput measured (one connection, `--seconds` s), the loss asked for against the loss seen, and
the relay's CPU time per second of traffic.

    .venv/bin/python scripts/bench/lab_faithfulness.py [--seconds 10]

`--busy N` runs N busy-looping processes beside it (a loaded machine), `--relay-normal` runs the
relay as a normal process instead of in the real-time class, `--only TEXT` the profiles whose
label contains TEXT.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

PROFILES = [  # (label, link of each of the two hosts)
    ("no shaping", {}),
    ("100 Mbit/s, no delay", {"up_mbit": 100, "down_mbit": 100}),
    ("50 ms RTT", {"delay_ms": 12.5}),
    ("50 ms RTT, jitter +-2 ms", {"delay_ms": 12.5, "jitter_ms": 1}),
    ("50 ms RTT, 100 Mbit/s", {"delay_ms": 12.5, "up_mbit": 100, "down_mbit": 100}),
    ("50 ms RTT, 100 Mbit/s, 0.5% loss", {"delay_ms": 12.5, "up_mbit": 100, "down_mbit": 100, "loss": 0.0025}),
    ("200 ms RTT, 20 Mbit/s", {"delay_ms": 50, "up_mbit": 20, "down_mbit": 20}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--probes", type=int, default=200)
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes to run beside it")
    parser.add_argument("--relay-normal", action="store_true", help="the relay as a normal process")
    parser.add_argument("--only", default="", help="only the profiles whose label contains this")
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        run(args)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def run(args: argparse.Namespace) -> None:
    from swarm.testing import HostSpec, Lab, LinkProfile

    py = sys.executable
    env = {**os.environ, "PYTHONPATH": ROOT}
    print(f"lab faithfulness: two hosts, one TCP connection for {args.seconds:g} s, {args.probes} UDP probes; "
          f"{args.busy} busy processes beside it; relay {'normal' if args.relay_normal else 'real-time'}", flush=True)
    for label, link in PROFILES:
        if args.only not in label:
            continue
        profile = LinkProfile(**link)
        with Lab([HostSpec("a", profile), HostSpec("b", profile)], seed=1, realtime_relay=not args.relay_normal) as lab:
            echo = lab.spawn("b", [py, "-m", "swarm.testing.probe", "echo", lab.address("b"), "9000"], env=env)
            echo.stdout.readline()
            rtt = json.loads(lab.exec("a", [py, "-m", "swarm.testing.probe", "rtt", lab.address("b"), "9000",
                                            str(args.probes), "0.01"], timeout=120).stdout)
            sink = lab.spawn("b", [py, "-m", "swarm.testing.probe", "sink", lab.address("b"), "9001"], env=env)
            sink.stdout.readline()
            cpu0 = lab.relay_stats()["cpu_seconds"] if lab.relay else 0.0
            t0 = time.monotonic()
            lab.exec("a", [py, "-m", "swarm.testing.probe", "source", lab.address("b"), "9001", str(args.seconds)],
                     timeout=args.seconds + 60)
            got = json.loads(sink.stdout.readline())
            wall = time.monotonic() - t0
            cpu = (lab.relay_stats()["cpu_seconds"] - cpu0) if lab.relay else 0.0
            packets = sum(q["seen"] for ns in lab.relay_stats()["queues"].values() for q in ns.values()) \
                if lab.relay else 0
        want_rtt = 4 * profile.delay_ms
        rate = profile.up_mbit
        print(f"  {label:<34} RTT asked {want_rtt:5.1f} ms, measured p10/p50/p90 {rtt['p10_ms']:6.1f}/"
              f"{rtt['p50_ms']:6.1f}/{rtt['p90_ms']:6.1f} ms; UDP lost {rtt['lost']}/{rtt['count']}; "
              f"TCP {got['mbit_per_s']:6.1f} Mbit/s" + (f" of {rate:g} ({100 * got['mbit_per_s'] / rate:.0f}%)" if rate else "")
              + (f"; relay CPU {100 * cpu / wall:.0f}% of a core for {packets} packets "
                 f"({1e6 * cpu / max(packets, 1):.1f} us each)" if packets else ""), flush=True)


if __name__ == "__main__":
    main()
