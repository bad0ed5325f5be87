"""SIGINT/SIGTERM reach a stopping handler that cannot deadlock the main thread (swarm/core/signals.py)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from swarm.core.loop import LoopThread

STOP_BITS = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
needs_proc = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread masks from /proc")


def blocked_mask(pid: int, tid: int) -> int:
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError("no SigBlk line")


def run_script(source: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True, check=False,
                          timeout=30, env={**os.environ, "PYTHONFAULTHANDLER": "1"})


def test_the_stop_callback_runs_off_the_main_thread_even_while_it_holds_the_callbacks_lock():
    # A handler on the main thread would run inside `with held:` and wait for `held` forever.
    done = run_script("""
        import os, signal, threading
        from swarm.core.signals import handle_stop_signals
        held, stopped, seen = threading.Lock(), threading.Event(), []
        def on_signal(signum):
            with held:
                seen.append((int(signum), threading.current_thread().name))
            stopped.set()
        handle_stop_signals(on_signal)
        with held:
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(100_000))  # bytecodes for a main-thread handler to run between
        assert stopped.wait(10), "the signal never reached the callback"
        print(seen)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"[({int(signal.SIGTERM)}, 'swarm-signals')]"


def test_each_signal_is_delivered_once_in_order():
    done = run_script("""
        import os, signal, threading
        from swarm.core.signals import handle_stop_signals
        seen, two = [], threading.Semaphore(0)
        handle_stop_signals(lambda s: (seen.append(int(s)), two.release()))
        os.kill(os.getpid(), signal.SIGINT)
        assert two.acquire(timeout=10)
        os.kill(os.getpid(), signal.SIGTERM)
        assert two.acquire(timeout=10)
        print(seen)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"[{int(signal.SIGINT)}, {int(signal.SIGTERM)}]"


@needs_proc
def test_the_peer_loop_thread_leaves_ctrl_c_to_the_main_thread():
    loop = LoopThread(name="swarm-loop-test")
    try:
        tid = loop.run(_native_id(), timeout=5)
        assert blocked_mask(os.getpid(), tid) & STOP_BITS == STOP_BITS
        assert blocked_mask(os.getpid(), threading.main_thread().native_id) & STOP_BITS == 0
    finally:
        loop.stop()


async def _native_id() -> int:
    return threading.get_native_id()
