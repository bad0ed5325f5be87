"""A SwarmTrainer peer SIGKILLed mid-run and restarted with resume_from_checkpoint rejoins and catches up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
pytest.importorskip("datasets", reason="the transformers extra is not installed")

from fast import RESTART
from gpt2_common import InThreads, byte_corpus, tiny_gpt2
from procs import read_stdout_lines

from swarm.integrations.session import SwarmArguments
from swarm.integrations.transformers import SwarmTrainer

pytestmark = [pytest.mark.alone, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 24
HOLD_AT = 14  # the live peers wait here (bounded) until the restarted peer is back
SCRIPT = Path(__file__).with_name("trainer_peer.py")


class Peer3:
    """The third peer, a process: its stdout lines are read as they come."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True, env=env)

    def wait_for(self, predicate, timeout: float) -> list[str]:
        """Reads lines until one satisfies `predicate`; returns all read."""
        seen: list[str] = []
        started = time.monotonic()
        while True:
            (line,) = read_stdout_lines(self.proc, 1, timeout, "trainer_peer", self.kill, self.stderr)
            seen.append(line)
            if predicate(line):
                print(f"{time.monotonic() - started:6.1f} s: {line}")
                return seen

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stderr(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.stderr.read()[-4000:] if self.proc.stderr else ""


class HoldAt(transformers.TrainerCallback):
    def __init__(self, step: int, released: threading.Event) -> None:
        self.step, self.released = step, released

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            self.released.wait(120)  # bounded: the test fails on its own checks if the peer never came back
        return control


def _step(line: str) -> int:
    return int(line.split()[1]) if line.startswith("step ") else -1


def test_a_killed_peer_resumes_from_its_checkpoint_rejoins_and_catches_up(swarm_peers, tmp_path):
    train, _ = byte_corpus(32, limit=150_000)
    released = threading.Event()
    peers = swarm_peers(2)
    models = [tiny_gpt2(context=32) for _ in peers]
    trainers = []
    for i, (peer, model) in enumerate(zip(peers, models)):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"live{i}"), per_device_train_batch_size=8, max_steps=STEPS,
            learning_rate=3e-3, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
            logging_steps=1000)
        trainers.append(SwarmTrainer(model=model, args=args, train_dataset=train, peer=peer, callbacks=[
            HoldAt(HOLD_AT, released)], swarm=SwarmArguments(run_id="restart", target_batch_size=24,
                                                              collaboration=RESTART, min_peers=3, peers_timeout=150)))
    live = InThreads([t.train for t in trainers])
    out = tmp_path / "third"
    common = ["--initial-peers", peers[0].addrs[0], "--identity", str(tmp_path / "third.key"), "--out", str(out),
              "--steps", str(STEPS)]
    third = Peer3(*common)
    restarted = Peer3(*common, "--stand-by")  # started now: its imports overlap the first run
    try:
        third.wait_for(lambda line: line == "saved 4", timeout=150)
        third.wait_for(lambda line: _step(line) >= 6, timeout=60)
        third.proc.send_signal(signal.SIGKILL)  # mid-run, after its first checkpoint
        third.proc.wait(10)
        restarted.wait_for(lambda line: line == "ready", timeout=150)
        checkpoint = max((p for p in out.iterdir() if p.name.startswith("checkpoint-")),
                         key=lambda p: int(p.name.split("-")[1]))
        saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
        saved_position = saved["sampler"]["passes"] * saved["sampler"]["num_samples"] + saved["sampler"]["offset"]
        third, restarted = restarted, third
        assert third.proc.stdin is not None
        third.proc.stdin.write(f"{checkpoint}\n")
        third.proc.stdin.flush()
        (position,) = third.wait_for(lambda line: line.startswith("position "), timeout=90)[-1:]
        # it goes on in its own order of the data where its checkpoint stopped: nothing trained before is replayed
        assert int(position.split()[1]) == saved_position > 0
        # it rejoins the swarm, which went on without it, and catches up with it
        lines = third.wait_for(lambda line: _step(line) >= HOLD_AT, timeout=60)
        assert max(_step(line) for line in lines) >= HOLD_AT > int(checkpoint.name.split("-")[1])
        released.set()
        third.wait_for(lambda line: _step(line) >= STEPS, timeout=90)
        assert third.proc.wait(60) == 0, third.stderr()
    finally:
        released.set()
        third.kill()
        restarted.kill()
        live.join(90)  # raises a live trainer's error, or if one did not end
    final = torch.load(out / "final.pt", weights_only=True)
    for model in models:
        assert all(torch.equal(a, b) for a, b in zip(final, model.parameters()))
