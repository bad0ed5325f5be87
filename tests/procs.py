"""Real `swarm-peer` processes for tests: start, read the addresses they print, signal, collect output."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Self


def read_stdout_lines(proc: subprocess.Popen, count: int, timeout: float, name: str,
                      kill: Callable[[], None], stderr: Callable[[], str]) -> list[str]:
    """Reads `count` lines from `proc`'s stdout within `timeout` seconds; on failure kills it and
    raises with what it wrote to stderr."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(lines) < count:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                kill()
                raise TimeoutError(f"{name} printed {lines} within {timeout} s; stderr:\n{stderr()}")
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{name} exited ({proc.wait()}); stderr:\n{stderr()}")
            lines.append(line.rstrip("\n"))
    return lines


class PeerProcess:
    """`python -m swarm ARGS` with stdout/stderr captured; `addrs` are the lines printed on ready.
    `python`: the interpreter (default this one; a venv's, to run what is installed there)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, cwd: str | None = None,
                 ready_timeout: float = 20.0, expect_addrs: int = 1, python: str = sys.executable) -> None:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [python, "-m", "swarm", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=full_env, cwd=cwd, text=True,
        )
        self.addrs: list[str] = []
        if expect_addrs:
            self.addrs = self.read_lines(expect_addrs, ready_timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read_lines(self, count: int, timeout: float) -> list[str]:
        """Reads `count` stdout lines, failing with the process's stderr if they do not come in time."""
        return read_stdout_lines(self.proc, count, timeout, "peer", self.kill, self.stderr_text)

    def read_log_until(self, done: Callable[[str], bool], timeout: float) -> str:
        """Reads the peer's log (stderr) until a line makes `done` true, and returns that line;
        fails with the last lines read if none does within `timeout` seconds or the log ends."""
        stream = self.proc.stderr
        assert stream is not None
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(stream, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                assert left > 0 and sel.select(left), "\n".join(seen[-20:])
                line = stream.readline()
                assert line, "\n".join(seen[-20:])
                seen.append(line.rstrip())
                if done(line):
                    return line

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 15.0) -> int:
        """The exit status; a peer still running after `timeout` is aborted, and the failure shows
        every thread's stack (faulthandler) and the rest of its stderr."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            raise AssertionError(f"peer still running {timeout} s on; its stderr:\n{self.stderr_text()}") from None

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stderr_text(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read() if self.proc.stderr else ""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


def start_peers(count: int, *extra: str, args_for: Sequence[Sequence[str]] | None = None) -> list[PeerProcess]:
    """Starts `count` peers on loopback; each after the first bootstraps from the first."""
    peers: list[PeerProcess] = []
    for i in range(count):
        args = ["--listen", "/ip4/127.0.0.1/tcp/0", *extra, *(args_for[i] if args_for else ())]
        if peers:
            args += ["--initial-peers", peers[0].addrs[0]]
        peers.append(PeerProcess(*args))
    return peers
