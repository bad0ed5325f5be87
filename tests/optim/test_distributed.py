"""A `torchrun` job as one swarm peer (`swarm.DistributedOptimizer`), with real processes on gloo.

A 2-rank job and a one-process peer train the demo model (small) together: every process holds
the same shared tensors at every epoch, the job's progress reports count both ranks' samples, and
a local rank killed with SIGKILL ends its job (torchrun's way) while rank 0 leaves the swarm
cleanly and the other peer trains on. Restarted by torchrun with the same identity, the job
rejoins and catches up. The unit tests at the end need no second process (a one-rank group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from swarm.core.errors import ConfigError
from swarm.optim import CollaborationConfig
from swarm.optim.distributed import DistributedOptimizer

WORKER = str(Path(__file__).parent / "dist_trainer_proc.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
START = 120.0  # seconds: torch's imports in three processes on two busy cores


def _start(args: list[str], out: Path, name: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1"}
    # a session of its own: `_stop` kills torchrun's workers with it
    return subprocess.Popen(args, stdout=open(out / f"{name}.out", "w"), stderr=open(out / f"{name}.err", "w"),
                            env=env, text=True, start_new_session=True)


def _wait_for(predicate, timeout: float, what: str, procs: list[subprocess.Popen[str]]) -> None:
    """Polls files the processes write until `predicate()` (bounded); fails if a process exits first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if any(p.poll() is not None for p in procs):
            if predicate():
                return
            raise AssertionError(f"a process exited while waiting for {what}")
        time.sleep(0.1)


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _digests(path: Path) -> dict[int, str]:
    return {r["epoch"]: r["digest"] for r in _lines(path)}


def _addr(path: Path) -> str | None:
    return next((line for line in path.read_text().splitlines() if line.startswith("/ip4/")), None) if (
        path.exists()) else None


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the process and whatever it started (torchrun's workers)
        except ProcessLookupError:
            pass
        p.wait()


def _rank_pid(path: Path, rank: int) -> int | None:
    for line in path.read_text().splitlines():
        if line.startswith(f"rank {rank} pid "):
            return int(line.split()[-1])
    return None


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_two_rank_job_is_one_identical_peer_counting_both_ranks_and_a_dead_rank_ends_only_its_job(
        tmp_path: Path) -> None:
    single = _start([sys.executable, WORKER, "--out", str(tmp_path), "--name", "single", "--epochs", "8",
                     "--batch", "8"], tmp_path, "single")
    procs = [single]
    try:
        _wait_for(lambda: _addr(tmp_path / "single.out") is not None, START, "the one-process peer", procs)
        job = _start([*TORCHRUN, "--nproc-per-node", "2", WORKER, "--out", str(tmp_path), "--name", "job",
                      "--epochs", "8", "--batch", "5", "3", "--initial-peers", _addr(tmp_path / "single.out")],
                     tmp_path, "job")
        procs.append(job)
        # both ranks write a line at the first batch of each epoch: wait for epoch 3 on rank 1
        _wait_for(lambda: 3 in _digests(tmp_path / "job-r1.jsonl"), START + 60, "epoch 3 on rank 1", procs)
        r0, r1 = _lines(tmp_path / "job-r0.jsonl"), _lines(tmp_path / "job-r1.jsonl")
        # progress counts the machine's batch: rank 0's count is both ranks' samples, step by step
        by_epoch = {r["epoch"]: r for r in r1 if "own" in r}
        for line in r0:
            if "own" in line and line["epoch"] in by_epoch and line["epoch"] > 0:
                assert line["machine"] == line["own"] + by_epoch[line["epoch"]]["own"], line
        killed_at = time.monotonic()
        os.kill(_rank_pid(tmp_path / "job.out", 1), signal.SIGKILL)
        # torchrun ends the job: it stops rank 0, which leaves the swarm first, and exits non-zero
        assert job.wait(60) != 0
        assert "the local ranks are gone" in (tmp_path / "job.err").read_text()
        assert "done" in (tmp_path / "job.out").read_text()  # rank 0 left cleanly, it was not killed
        # the other peer trains on: alone once the job's record is withdrawn
        assert single.wait(60) == 0
        assert time.monotonic() - killed_at < 60
    finally:
        _stop(procs)
    single_digests = _digests(tmp_path / "single-r0.jsonl")
    r0_digests, r1_digests = _digests(tmp_path / "job-r0.jsonl"), _digests(tmp_path / "job-r1.jsonl")
    common = [e for e in r1_digests if e > 0 and e in r0_digests and e in single_digests]
    assert len(common) >= 2, (r0_digests, r1_digests, single_digests)
    for e in common:  # every process holds the same shared parameters after every collective step
        assert r0_digests[e] == r1_digests[e] == single_digests[e], e
    # the one-process peer read the job's reports: samples of both ranks (5 + 3 per step), never rank 0's alone
    seen = [s for s in _lines(tmp_path / "single-r0.jsonl")[-1]["seen"] if s > 0]
    assert seen and all(s % 8 == 0 for s in seen) and any(s % 5 for s in seen), seen


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_job_restarted_with_its_identity_rejoins_and_catches_up_in_diloco_mode(tmp_path: Path) -> None:
    single = _start([sys.executable, WORKER, "--out", str(tmp_path), "--name", "single", "--epochs", "6",
                     "--batch", "8", "--diloco", "--wait-rejoin", "3"], tmp_path, "single")
    procs = [single]
    try:
        _wait_for(lambda: _addr(tmp_path / "single.out") is not None, START, "the one-process peer", procs)
        job = [*TORCHRUN, "--nproc-per-node", "2", WORKER, "--out", str(tmp_path), "--name", "job", "--epochs", "6",
               "--batch", "5", "3", "--diloco", "--identity", str(tmp_path / "job.key"),
               "--initial-peers", _addr(tmp_path / "single.out")]
        first = _start(job, tmp_path, "first")
        procs.append(first)
        # killed as soon as it trains: long before the epoch at which the other peer waits for it
        _wait_for(lambda: 0 in _digests(tmp_path / "job-r1.jsonl"), START + 60, "rank 1 training", procs)
        os.kill(_rank_pid(tmp_path / "first.out", 1), signal.SIGKILL)
        assert first.wait(60) != 0
        # the job started again (by its operator, or a service manager) under the same identity
        second = _start(job, tmp_path, "second")
        procs.append(second)
        assert second.wait(START + 120) == 0
        assert single.wait(60) == 0
    finally:
        _stop(procs)
    addrs = [_addr(tmp_path / f"{run}.out") for run in ("first", "second")]
    assert addrs[0] is not None and addrs[1] is not None
    assert addrs[0].rsplit("/", 1)[1] == addrs[1].rsplit("/", 1)[1], addrs  # the same PeerID
    assert "loaded the swarm's state: epoch 3" in (tmp_path / "second.err").read_text()
    single_digests = _digests(tmp_path / "single-r0.jsonl")
    for rank in (0, 1):  # from the epoch it loaded on, every rank of the restarted job holds what the swarm holds
        later = [r for r in _lines(tmp_path / f"job-r{rank}.jsonl") if r["epoch"] >= 3 and r["epoch"] in single_digests]
        assert later, rank
        for line in later:
            assert line["digest"] == single_digests[line["epoch"]], line


# the training integrations' workers (`dist_steps.py`) and the extras each needs
INTEGRATIONS = {
    "trainer": (str(Path(__file__).parent / "dist_hf_proc.py"), ("transformers", "datasets")),
    "lightning": (str(Path(__file__).parent / "dist_lightning_proc.py"), ("lightning.pytorch", "transformers")),
}


def _worker(integration: str) -> str:
    worker, modules = INTEGRATIONS[integration]
    for module in modules:
        pytest.importorskip(module, reason=f"the {module.split('.')[0]} extra is not installed")
    return worker


def _checkpoint(integration: str, run: Path, step: int) -> tuple[Path, dict]:
    """The checkpoint a worker saved at `step`, and the swarm state it holds (the optimizer's)."""
    if integration == "trainer":
        path = run / f"checkpoint-{step}"
        return path, torch.load(path / "optimizer.pt", weights_only=False)
    path = run / f"checkpoint-{step}.ckpt"
    return path, torch.load(path, weights_only=False)["optimizer_states"][0]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("integration", INTEGRATIONS)
def test_a_two_rank_job_of_an_integration_is_one_peer_identical_to_a_one_process_peer(
        tmp_path: Path, integration: str) -> None:
    worker = _worker(integration)
    steps = ["--steps", "4"]
    single = _start([sys.executable, worker, "--out", str(tmp_path), "--name", "single", *steps], tmp_path, "single")
    procs = [single]
    try:
        _wait_for(lambda: _addr(tmp_path / "single.out") is not None, START, "the one-process peer", procs)
        # the user's script unchanged, under torchrun: the integration (or the Trainer) starts gloo,
        # and the ranks are one peer
        job = _start([*TORCHRUN, "--nproc-per-node", "2", worker, "--out", str(tmp_path), "--name", "job", *steps,
                      "--initial-peers", _addr(tmp_path / "single.out")], tmp_path, "job")
        procs.append(job)
        assert job.wait(START + 120) == 0, (tmp_path / "job.err").read_text()[-3000:]
        assert single.wait(60) == 0, (tmp_path / "single.err").read_text()[-3000:]
    finally:
        _stop(procs)
    runs = {name: _lines(tmp_path / f"{name}.jsonl") for name in ("job-r0", "job-r1", "single-r0")}
    digests = {name: {r["epoch"]: r["digest"] for r in lines} for name, lines in runs.items()}
    # the step limit counts the swarm's steps: all three stopped at the 4th, holding the same parameters at each
    assert all(lines[-1]["epoch"] == 4 for lines in runs.values()), runs
    for e in range(1, 5):
        assert digests["job-r0"][e] == digests["job-r1"][e] == digests["single-r0"][e], e
    # the job is one peer counting both ranks' samples: rank 0's optimizer took in both ranks' batches,
    # and the other peer read reports of 16 samples a step (8 per rank), never rank 0's 8 alone
    r0, r1 = runs["job-r0"][-1], runs["job-r1"][-1]
    # (a batch a catch-up drops is not counted: at most both ranks' batches)
    assert r0["own"] == r1["own"] > 0 and r0["own"] < r0["machine"] <= r0["own"] + r1["own"], (r0, r1)
    assert r0["machine"] % 16 == 0, r0
    seen = [s for s in runs["single-r0"][-1]["seen"] if s > 0]
    assert seen and all(s % 16 == 0 for s in seen), seen
    # the ranks drew their batches from one order of the data (rank 0's PeerID seeds it) and are at
    # one place in it; rank 0 alone is the framework's global rank zero (it writes checkpoints and logs)
    assert r0["position"] == r1["position"] > 0, (r0, r1)
    assert r0["global_zero"] and not r1["global_zero"], (r0, r1)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("integration", INTEGRATIONS)
def test_a_job_of_an_integration_in_diloco_mode_resumes_from_its_checkpoint_on_every_rank(
        tmp_path: Path, integration: str) -> None:
    worker = _worker(integration)
    # alone, 3 inner steps a round: 9 steps are 3 rounds; a checkpoint every 3 steps, written by rank 0
    job = [*TORCHRUN, "--nproc-per-node", "2", worker, "--out", str(tmp_path), "--min-peers", "1", "--diloco"]
    first = _start([*job, "--name", "first", "--steps", "9", "--save-steps", "3"], tmp_path, "first")
    try:
        assert first.wait(START + 120) == 0, (tmp_path / "first.err").read_text()[-3000:]
    finally:
        _stop([first])
    before = [_digests(tmp_path / f"first-r{rank}.jsonl") for rank in (0, 1)]
    assert before[0] == before[1] and max(before[0]) == 3, before
    saved, state = _checkpoint(integration, tmp_path / "first", 6)
    assert state["swarm_optimizer"]["metadata"]["epoch"] == 2 and state["inner_steps"] == 6, state["inner_steps"]
    resumed = _start([*job, "--name", "resumed", "--steps", "12", "--resume", str(saved)], tmp_path, "resumed")
    try:
        assert resumed.wait(START + 120) == 0, (tmp_path / "resumed.err").read_text()[-3000:]
    finally:
        _stop([resumed])
    after = [_lines(tmp_path / f"resumed-r{rank}.jsonl") for rank in (0, 1)]
    # both ranks took the checkpoint's state (round 2's parameters, bit for bit), went on to round 4
    # (12 inner steps) and stayed identical
    for lines in after:
        assert lines[0]["epoch"] == 2 and lines[0]["digest"] == before[0][2], lines
        assert lines[-1]["epoch"] == 4, lines
    assert {r["epoch"]: r["digest"] for r in after[0]} == {r["epoch"]: r["digest"] for r in after[1]}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(300)
def test_a_two_gpu_job_on_nccl_stays_identical_with_a_one_process_gpu_peer(tmp_path: Path) -> None:
    single = _start([sys.executable, WORKER, "--out", str(tmp_path), "--name", "single", "--epochs", "4",
                     "--batch", "8", "--device", "cuda"], tmp_path, "single")
    procs = [single]
    try:
        _wait_for(lambda: _addr(tmp_path / "single.out") is not None, START, "the one-process peer", procs)
        job = _start([*TORCHRUN, "--nproc-per-node", "2", WORKER, "--out", str(tmp_path), "--name", "job",
                      "--epochs", "4", "--batch", "5", "3", "--device", "cuda",
                      "--initial-peers", _addr(tmp_path / "single.out")], tmp_path, "job")
        procs.append(job)
        assert job.wait(START + 60) == 0
        assert single.wait(60) == 0
    finally:
        _stop(procs)
    digests = [_digests(tmp_path / f"{name}.jsonl") for name in ("job-r0", "job-r1", "single-r0")]
    common = [e for e in digests[0] if e > 0 and all(e in d for d in digests)]
    assert common, digests
    for e in common:
        assert digests[0][e] == digests[1][e] == digests[2][e], e


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (removed again after the test)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_without_torch_distributed_it_says_how_to_start(make_peer) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="init_process_group"):
        DistributedOptimizer(make_peer(), "r", model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1), 8)


def test_rank_zero_must_bring_the_peer(one_rank_group) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="rank 0 passes its swarm.Peer"):
        DistributedOptimizer(None, "r", model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1), 8)


def test_a_sharded_model_is_refused_with_the_reason(one_rank_group, make_peer) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
    with pytest.raises(ConfigError, match="whole model"):
        DistributedOptimizer(make_peer(), "r", [sharded], lambda ps: torch.optim.SGD(ps, lr=0.1), 8)


def test_a_one_rank_job_trains_as_a_plain_optimizer_would(one_rank_group, make_peer) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    config = CollaborationConfig(target_batch_size=8, report_period=0.1, max_staleness=0)
    opt = DistributedOptimizer(make_peer(), "one", model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1),
                               config=config)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    try:
        for i in range(2):
            torch.nn.functional.mse_loss(model(x[4 * i:4 * i + 4]), y[4 * i:4 * i + 4]).backward()
            out = opt.step(4)
            opt.zero_grad()
        assert out.stepped and opt.epoch == 1
        torch.nn.functional.mse_loss(reference(x), y).backward()
        plain.step()
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(mine, theirs)
    finally:
        opt.shutdown()


def test_a_misspelt_setting_is_refused_by_both_constructors(one_rank_group, make_peer) -> None:
    from swarm.optim import Optimizer

    model = torch.nn.Linear(2, 2)
    for cls in (Optimizer, DistributedOptimizer):
        with pytest.raises(TypeError, match="unexpected keyword arguments \\['confg'\\]"):
            cls(make_peer(), "r", model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1), 8, confg=None)
    with pytest.raises(TypeError, match="wraps the mode itself"):
        DistributedOptimizer(make_peer(), "r", model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1), 8,
                             mode_wrapper=lambda mode: mode)


def test_a_process_alone_or_in_a_one_rank_group_is_a_peer_of_its_own(make_peer) -> None:
    from swarm.optim.distributed import is_following_rank, job_ranks, machine_peer_id

    peer = make_peer()
    assert job_ranks() is None and not is_following_rank() and machine_peer_id(peer) == peer.peer_id
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # a group of one rank is not a job of several: the process stays a peer of its own
        assert job_ranks() is None and not is_following_rank()
    finally:
        dist.destroy_process_group()
