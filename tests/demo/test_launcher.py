"""`python -m swarm.demo` as a person runs it: a real expert server and trainers, then Ctrl+C."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time

import pytest


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_trains_then_stops_cleanly_on_ctrl_c(tmp_path):
    out_dir = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarm.demo", "--trainers", "2", "--duration", "600", "--target-batch-size", "32",
         "--sample-length", "24", "--out-dir", str(out_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    try:
        # wait until both trainers have taken collective steps together
        deadline = time.monotonic() + 150
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while not any(re.search(r"trainer-1 .* 2 peers \| epoch +([3-9]|\d\d)", line) for line in lines[-3:]):
                assert time.monotonic() < deadline and sel.select(deadline - time.monotonic()), "\n".join(lines)
                line = proc.stdout.readline()
                assert line, "\n".join(lines)
                lines.append(line.rstrip("\n"))
        proc.send_signal(signal.SIGINT)  # what Ctrl+C sends to the launcher
        rest, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    output = "\n".join(lines) + "\n" + rest
    assert proc.returncode == 0, output
    assert "stopping trainer-0" in output and "exited with status" not in output
    start, end = map(float, re.search(r"held-out loss\s+([\d.]+) -> ([\d.]+)", output).groups())
    assert end < start - 1.0, output  # the loss fell (ln 256 = 5.5 at the start)
    assert "text before" in output and "text after" in output
    assert (out_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    for log in (out_dir / "logs").iterdir():  # every child exited 0 without a traceback
        assert "Traceback" not in log.read_text(), log
