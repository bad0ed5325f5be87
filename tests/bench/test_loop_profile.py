"""scripts/bench/loop_profile.py: a loop thread's py-spy samples sorted by what the loop served."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "loop_profile.py"
LOOP = ("thread (7): swarm-AbCd;Thread._bootstrap (threading.py:1002);"
        "LoopThread._main (swarm/core/loop.py:45)")

pytestmark = pytest.mark.timeout(60)


def test_samples_count_once_under_the_first_matching_category_and_other_threads_not_at_all(tmp_path: Path) -> None:
    raw = tmp_path / "spy.txt"
    raw.write_text("\n".join([
        f"{LOOP} 6",  # uvloop's own code: nothing below the loop's frame
        f"{LOOP};ButterflyAllReduce.run (swarm/averaging/allreduce.py:184);Sealer.seal_at (swarm/net/sealed.py:190) 3",
        f"{LOOP};ProgressTracker._run (swarm/optim/tracker.py:200);DHT.store (swarm/dht/dht.py:300) 1",
        "thread (1): MainThread;worker (bench_training.py:209) 50",  # the training thread: not the loop's
        "",
    ]))
    out = subprocess.run([sys.executable, str(SCRIPT), str(raw)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "10 samples of peer loop threads in 1 file(s)"
    assert lines[1:] == [
        " 60.0%  uvloop's own code (no Python frame below the loop)",
        " 30.0%  all-reduce (parts encoded, sent, received, summed)",
        " 10.0%  progress tracker",
    ]
