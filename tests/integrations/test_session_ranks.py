"""`SwarmSession` (and Lightning's `SwarmStrategy`, which starts the peer itself) in a 2-rank torch.distributed job (real processes on gloo) whose rank 0 cannot
join the swarm: every rank raises at once, rank 0 its own error and the other rank a
`LocalRankError` naming it, instead of waiting for rank 0 in a collective until the process group
times out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import read_stdout_lines

WORKER = str(Path(__file__).parent / "session_rank_proc.py")
PG_TIMEOUT = 300.0  # the process group's: far beyond the test's, so a rank left waiting fails the test


def _start(rank: int, tmp_path: Path, env: dict[str, str], extra: list[str]) -> subprocess.Popen[str]:
    with open(tmp_path / f"r{rank}.err", "w") as err:  # the child keeps its own handle
        return subprocess.Popen([sys.executable, WORKER, "--rank", str(rank), "--store", str(tmp_path / "store"),
                                 "--timeout", str(PG_TIMEOUT), *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lightning", [False, True], ids=["session", "lightning"])
def test_when_rank_0_cannot_join_every_rank_raises_instead_of_waiting(tmp_path: Path, lightning: bool) -> None:
    if lightning:
        pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    procs = [_start(rank, tmp_path, env, ["--lightning"] if lightning else []) for rank in (0, 1)]
    try:
        # both ranks stay in the job after their line (until their stdin closes): rank 1 cannot
        # learn of rank 0's failure from its connection closing, only from the session itself
        lines = [read_stdout_lines(p, 1, 90, f"rank {rank}", p.kill, (tmp_path / f"r{rank}.err").read_text)[0]
                 for rank, p in enumerate(procs)]
        assert lines[0].startswith("0 MultiaddrError: a multiaddr starts with '/'"), lines
        assert lines[1].startswith("1 LocalRankError: local rank 1: rank 0 could not join the swarm: "
                                   "MultiaddrError: a multiaddr starts with '/'"), lines
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
        for rank, p in enumerate(procs):
            assert p.wait(30) == 0, (tmp_path / f"r{rank}.err").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for pipe in (p.stdin, p.stdout):
                if pipe is not None and not pipe.closed:
                    pipe.close()
