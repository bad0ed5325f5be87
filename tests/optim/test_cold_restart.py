"""A run outlives its peers, all real processes killed with SIGKILL:

- three trainers checkpoint into a directory they share, all are killed at once, the newest
  checkpoint is truncated (a crash mid-copy, a bad disk), and three new processes started with
  `resume_from=DIR` go on from the checkpoint before it, bit-identical to it, and train on;
- three trainers and an archiver (`swarm-peer --archive`) are killed at once; the archiver
  restarted with its identity announces what it holds in the DHT, and three new trainers named
  only its PeerID (`resume_from=PeerID`) find it there, resume at its newest epoch with
  parameters bit-identical to that checkpoint, and train on.
"""

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
from procs import PeerProcess

from swarm.checkpoint import CheckpointStore
from swarm.checkpoint.format import TENSORS_FILE

HERE = Path(__file__).parent


class Trainer:
    """`checkpoint_proc.py` with its stdout read line by line and its log in a file."""

    def __init__(self, directory: Path | None, log: Path, seed: int, resume: bool, initial_peer: str | None,
                 resume_from: str | None = None) -> None:
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "checkpoint_proc.py"), "--seed", str(seed), "--peers", "3",
                 *(["--dir", str(directory)] if directory else []), *(["--resume"] if resume else []),
                 *(["--resume-from", resume_from] if resume_from else []),
                 *(["--initial-peers", initial_peer] if initial_peer else [])],
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


def assert_resumed(starts: list[list[str]], epoch: int, digest: str) -> None:
    """Each trainer's ``start EPOCH SHA256``: fresh random weights replaced by the checkpoint's
    state, bit for bit; a trainer whose start overlapped the others' first step may take the
    swarm's newer state instead, as any joiner does (seen at load 25)."""
    resumed = [(int(e), d) for e, d in starts]
    assert (epoch, digest) in resumed, (resumed, epoch)
    assert all(e > epoch or (e, d) == (epoch, digest) for e, d in resumed), (resumed, epoch)


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
        starts = [t.read_until(lambda line: line.startswith("start "), 60).split()[1:] for t in trainers]
        assert_resumed(starts, intact.epoch, expected)
        for t in trainers:  # the swarm trains on, together, from there
            t.wait_for_epoch(intact.epoch + 2, 120)
        logs = "".join(t.log.read_text(errors="replace") for t in trainers)
        assert "is damaged, trying the one before" in logs
    finally:
        for t in trainers:
            t.kill()



def archived_epoch(line: str) -> int:
    """The epoch of an archiver's ``archived epoch N in ...`` log line, else -1."""
    words = line.split("archived epoch ", 1)
    return int(words[1].split()[0]) if len(words) == 2 else -1


@pytest.mark.timeout(360)
def test_trainers_and_their_archiver_killed_then_restarted_resume_at_the_newest_archived_epoch(
        tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    archiver_args = ("--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "archiver.key"),
                     "--archive", str(archive), "--run", "cold", "--archive-every", "1")
    with PeerProcess(*archiver_args, ready_timeout=90) as archiver:
        archiver_id = archiver.addrs[0].rsplit("/p2p/", 1)[1]
        trainers = [Trainer(None, tmp_path / f"first-{i}.log", seed=i, resume=False, initial_peer=archiver.addrs[0])
                    for i in range(3)]
        try:
            for t in trainers:
                t.ready()
            archiver.read_log_until(lambda line: archived_epoch(line) >= 3, 150)
        finally:  # SIGKILL, every process at once: no clean shutdown, no last save
            for proc in [t.proc for t in trainers] + [archiver.proc]:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
            for t in trainers:
                t.kill()
            archiver.kill()
    newest = CheckpointStore(archive).load_newest("cold")
    assert newest.epoch >= 3 and newest.epoch == CheckpointStore(archive).epochs()[0]
    expected = hashlib.sha256(b"".join(bytes(t.data) for t in newest.params)).hexdigest()

    with PeerProcess(*archiver_args, ready_timeout=90) as archiver:
        assert archiver.addrs[0].endswith(f"/p2p/{archiver_id}")  # its identity: the PeerID trainers trust
        archiver.read_log_until(lambda line: "announced the archive of epochs" in line, 60)
        trainers = [Trainer(None, tmp_path / f"resumed-{i}.log", seed=i, resume=False,
                            initial_peer=archiver.addrs[0], resume_from=archiver_id) for i in range(3)]
        try:
            for t in trainers:
                t.ready()
            starts = [t.read_until(lambda line: line.startswith("start "), 90).split()[1:] for t in trainers]
            assert_resumed(starts, newest.epoch, expected)
            logs = "".join(t.log.read_text(errors="replace") for t in trainers)
            assert f"the archiver {archiver_id} announces epochs" in logs
            assert "resuming from the archiver /ip4/127.0.0.1/" in logs
            for t in trainers:  # and the swarm trains on, together, from there
                t.wait_for_epoch(newest.epoch + 2, 120)
        finally:
            for t in trainers:
                t.kill()
