"""The dashboard at scale: snapshot cost on the serving peer and render/update time in a real browser.

    python scripts/bench/bench_dashboard.py [--peers 200] [--experts 10000] [--snapshots 10] [--refresh 1.0]

A synthetic swarm (`swarm.dashboard.synthetic.SyntheticSwarm`: the collector's real `Picture`,
with what peers say of themselves in their answers, and no network) is served by a real `DashboardServer` and opened in Debian's
headless chromium (tests/dashboard/browser.py); the baseline is a small swarm (4 peers, 4
experts) measured the same way in the same invocation. One JSON line per figure and swarm:

    snapshot_ms    building one snapshot on the serving peer (median of --snapshots)
    snapshot_kb / experts_kb    one live update's size, and the grid's (sent when it changes)
    first_picture_ms    page load to peers and expert grid drawn
    experts_render_ms   drawing the whole grid
    update_ms_mean / update_ms_median / update_ms_max    redrawing peers, runs and charts at each live update
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "dashboard"))

from browser import browser_missing, chrome

from swarm.core.loop import LoopThread
from swarm.dashboard.collector import DashboardConfig
from swarm.dashboard.server import DashboardServer
from swarm.dashboard.synthetic import SyntheticSwarm


def measure(label: str, peers: int, experts: int, snapshots: int, refresh: float) -> None:
    def emit(figure: str, value: float) -> None:
        print(json.dumps({"swarm": label, "peers": peers, "experts": experts, "figure": figure,
                          "value": round(value, 2)}), flush=True)

    source = SyntheticSwarm(peers=peers, experts=experts, runs=1, trainers=max(1, peers // 2),
                            servers=max(1, peers // 4))
    probe = SyntheticSwarm(peers=peers, experts=experts, runs=1, trainers=max(1, peers // 2),
                           servers=max(1, peers // 4))
    costs = []
    for _ in range(snapshots):
        started = time.perf_counter()
        view = asyncio.run(probe.acollect())
        costs.append((time.perf_counter() - started) * 1000)
    grid = view.pop("experts")
    emit("snapshot_ms", statistics.median(costs))
    emit("snapshot_kb", len(json.dumps(view, separators=(",", ":"))) / 1024)
    emit("experts_kb", len(json.dumps(grid, separators=(",", ":"))) / 1024)

    loop = LoopThread("bench-dashboard")
    server = DashboardServer(source, DashboardConfig(refresh_period=refresh))
    loop.run(server.astart(), timeout=60)
    try:
        with TemporaryDirectory() as tmp, chrome(Path(tmp)) as driver:
            driver.set_script_timeout(120)
            driver.get(server.url)
            deadline = time.monotonic() + snapshots * refresh * 4 + 60
            stats: dict = {}
            while time.monotonic() < deadline:
                stats = driver.execute_async_script(
                    "const done = arguments[0]; setTimeout(() => done(window.dashboardStats || {}), 250);")
                if stats.get("snapshots", 0) >= snapshots and stats.get("firstCompleteMs") is not None:
                    break
            if stats.get("snapshots", 0) < snapshots:
                raise SystemExit(f"the page took in only {stats.get('snapshots')} updates: {stats}")
            emit("first_picture_ms", stats["firstCompleteMs"])
            emit("experts_render_ms", stats["expertsRenderMs"])
            emit("update_ms_mean", stats["totalRenderMs"] / stats["snapshots"])
            emit("update_ms_median", statistics.median(stats["renders"]))  # a loaded machine's pauses move the mean
            emit("update_ms_max", stats["maxRenderMs"])
    finally:
        loop.run(server.ashutdown(), timeout=30)
        loop.loop.call_soon_threadsafe(loop.loop.stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=200)
    parser.add_argument("--experts", type=int, default=10_000)
    parser.add_argument("--snapshots", type=int, default=10, help="live updates the page takes in")
    parser.add_argument("--refresh", type=float, default=1.0, help="seconds between updates")
    args = parser.parse_args()
    missing = browser_missing()
    if missing:
        raise SystemExit(f"no browser: {missing}")
    measure("baseline", 4, 4, args.snapshots, args.refresh)
    measure("large", args.peers, args.experts, args.snapshots, args.refresh)


if __name__ == "__main__":
    main()
