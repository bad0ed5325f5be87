"""A run outlives its peers: three trainer processes checkpoint into a directory they share, all are
SIGKILLed at once, the newest checkpoint is truncated (a crash mid-copy, a bad disk), and three
new processes started with `resume_from` go on from the checkpoint before it, with parameters
bit-identical to it, and train on together."""

from __future__ import annotations

import hashlib
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.checkpoint import CheckpointStore
from swarm.checkpoint.format import TENSORS_FILE

HERE = Path(__file__).parent


class Trainer:
    """`checkpoint_proc.py` with its stdout read line by line and its log in a file."""

    def __init__(self, directory: Path, log: Path, seed: int, resume: bool, initial_peer: str | None) -> None:
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "checkpoint_proc.py"), "--dir", str(directory), "--seed", str(seed), "--peers", "3",
                 *(["--resume"] if resume else []), *(["--initial-peers", initial_peer] if initial_peer else [])],
                stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []

    def ready(self) -> str:
        """Its address, once it printed it."""
        return self.read_until(lambda line: line.startswith("/ip4/"), 90)

    def read_until(self, done: object, timeout: float) -> str:
        """Reads lines until `done(line)`; returns that line."""
        assert callable(done)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError(f"trainer printed {self.lines[-5:]}; log:\n{self.tail()}")
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"trainer exited {self.proc.wait()}; log:\n{self.tail()}")
                self.lines.append(line.strip())
                if done(line.strip()):
                    return line.strip()

    def wait_for_epoch(self, epoch: int, timeout: float) -> None:
        self.read_until(lambda line: line.startswith("epoch ") and int(line.split()[1]) >= epoch, timeout)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def start_swarm(directory: Path, logs: Path, resume: bool) -> list[Trainer]:
    """The first trainer, then the two others at once (they bootstrap from the first)."""
    name = "resumed" if resume else "first"
    trainers = [Trainer(directory, logs / f"{name}-0.log", seed=0, resume=resume, initial_peer=None)]
    try:
        first = trainers[0].ready()
        for i in (1, 2):
            trainers.append(Trainer(directory, logs / f"{name}-{i}.log", seed=i, resume=resume, initial_peer=first))
        for t in trainers[1:]:
            t.ready()
    except BaseException:
        for t in trainers:
            t.kill()
        raise
    return trainers


@pytest.mark.timeout(360)
def test_every_trainer_killed_then_restarted_resumes_bit_for_bit_from_the_newest_intact_checkpoint(
        tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    store = CheckpointStore(directory)
    trainers = start_swarm(directory, tmp_path, resume=False)
    try:
        for t in trainers:
            t.wait_for_epoch(4, 120)
    finally:
        for t in trainers:  # SIGKILL, all at once: no clean shutdown, no last save
            t.proc.send_signal(signal.SIGKILL)
        for t in trainers:
            t.kill()
    epochs = store.epochs()
    assert len(epochs) >= 2 and epochs[0] >= 3, epochs
    newest = store.path_of(epochs[0]) / TENSORS_FILE
    os.truncate(newest, newest.stat().st_size - 100)
    intact = store.load_newest("cold")
    assert intact.epoch == epochs[1]
    expected = hashlib.sha256(b"".join(bytes(t.data) for t in intact.params)).hexdigest()

    trainers = start_swarm(directory, tmp_path, resume=True)
    try:
        for t in trainers:
            start = t.read_until(lambda line: line.startswith("start "), 60).split()
            assert (int(start[1]), start[2]) == (intact.epoch, expected), (start, intact.epoch)
        for t in trainers:  # the swarm trains on, together, from there
            t.wait_for_epoch(intact.epoch + 2, 120)
        logs = "".join(t.log.read_text(errors="replace") for t in trainers)
        assert "is damaged, trying the one before" in logs
    finally:
        for t in trainers:
            t.kill()
