"""Short versions of the lab's shipped scenarios (needs root): the demo's swarm with a trainer
behind NAT over delayed, lossy links; averaging and the DHT across hosts. The long versions are
benchmarks (scripts/bench/lab_*.py); these check that they work, not how fast."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from swarm.testing import report
from swarm.testing.netns import lab_namespaces
from swarm.testing.runner import Run
from swarm.testing.scenario import parse

pytestmark = [pytest.mark.usefixtures("needs_lab"), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_the_wan_demo_trains_with_a_trainer_behind_nat(tmp_path: Path) -> None:
    data = tomllib.loads((ROOT / "swarm/testing/scenarios/wan-demo.toml").read_text())
    data["duration"] = 100
    data["hosts"] = [h for h in data["hosts"] if h["name"] in ("experts", "t1", "home")]
    data["processes"] = [p for p in data["processes"] if p["name"] in ("server", "trainer1", "home")]
    for p in data["processes"]:
        if "--duration" in p["command"]:
            i = p["command"].index("--duration")
            p["command"][i + 1] = "25"
            p["command"][p["command"].index("--target-batch-size") + 1] = "32"
    run = Run(parse(data), tmp_path, live=False)
    events = run.run()
    figures = report.figures(events, run.relay)
    assert lab_namespaces(events[0]["prefix"]) == []
    assert figures["crashes"] == []
    assert set(figures["trainers"]) == {"trainer1", "home"}
    assert figures["trainers"]["home"]["epoch"] >= 1  # the NAT trainer took part in collective steps
    assert figures["trainers"]["home"]["averaging_bytes"] > 0
    digests = figures["digests"]  # bit-identical shared parameters after each collective step
    assert digests["epochs_compared"] >= 1 and digests["mismatched"] == {}, digests
    assert sum(q["dropped"] for ns in figures["relay"]["queues"].values() for q in ns.values()) > 0


def bench(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "scripts/bench" / name), *args], capture_output=True,
                          text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_averaging_across_hosts_completes_in_fp32_and_fp16() -> None:
    out = bench("lab_averaging.py", "--peers", "2", "--mbytes", "4", "--rounds", "1", "--mbit", "50")
    lines = [line for line in out.splitlines() if "of the bound" in line]
    assert len(lines) == 4, out
    assert "round failed" not in out


def test_the_dht_works_across_hosts() -> None:
    out = bench("lab_dht.py", "--nodes", "4", "--ops", "5", "--delay-ms", "5")
    assert "get" in out and "RTT" in out, out
