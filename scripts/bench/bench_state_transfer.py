#!/usr/bin/env python
"""Benchmark: one state download (`swarm.averaging.state`) between two peers on loopback, over TLS.

Both peers run in this process, each on its own event loop thread; the state is three float32
tensors of `--numel` elements (9.51M: the 480-wide byte LM's parameters and Adam's two moments,
114 MB, what a trainer of `bench_overlap.py --hidden-dim 480` downloads when it falls behind).
Prints each download's wall time and the process's CPU time for it (both peers together).

    .venv/bin/python scripts/bench/bench_state_transfer.py [--numel 9510000] [--repeat 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=9_510_000, help="elements of each of the three tensors")
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args()

    import torch

    import swarm
    from swarm.averaging.state import State, StateServer, load_state_from_peers

    torch.set_num_threads(1)
    server = swarm.Peer(listen="/ip4/127.0.0.1/tcp/0")
    client = swarm.Peer(listen="/ip4/127.0.0.1/tcp/0")
    try:
        tensors = [torch.randn(args.numel) for _ in range(3)]
        StateServer(server, "bench", lambda: State({"epoch": 0}, tensors), snapshot_ttl=0.0)
        for _ in range(args.repeat):
            wall, cpu = time.perf_counter(), time.process_time()
            got = load_state_from_peers(client, "bench", [server.addrs[0]], timeout=120)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            size = sum(t.numel() * t.element_size() for t in got.tensors) / 1e6
            assert all(torch.equal(a, b) for a, b in zip(got.tensors, tensors))
            print(f"state download, {size:.0f} MB over TLS on loopback: {wall:.2f} s wall, {cpu:.2f} s of CPU "
                  f"(both peers)", flush=True)
    finally:
        client.shutdown()
        server.shutdown()


if __name__ == "__main__":
    main()
