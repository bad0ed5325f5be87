"""`python -m swarm.demo --hostile-experts x1e6`: the demo trains through a hostile expert server."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_demo_trains_with_one_of_its_expert_servers_hostile(tmp_path):
    out_dir = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "swarm.demo", "--trainers", "1", "--duration", "30", "--target-batch-size", "32",
         "--sample-length", "8", "--hostile-experts", "x1e6", "--out-dir", str(out_dir)],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=200,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = done.stdout
    assert done.returncode == 0, output
    assert "HOSTILE expert server (x1e6)" in output
    start, end = map(float, re.search(r"held-out loss\s+([\d.]+) -> ([\d.]+)", output).groups())
    assert end < start - 1.0, output  # the loss fell as in the honest demo (ln 256 = 5.5 at the start)
    rejected = int(re.search(r"expert answers: (\d+) rejected", output).group(1))
    assert rejected >= 1, output  # the liar was caught, not merely outvoted
    log = (out_dir / "logs" / "trainer-0.log").read_text()
    assert "skipped for this batch, its server avoided" in log and "Traceback" not in log
    assert "exited with status" not in output
