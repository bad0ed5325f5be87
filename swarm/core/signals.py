"""SIGINT and SIGTERM, the signals that ask a swarm process to stop.

A Python signal handler runs on the main thread, between any two bytecodes of whatever it was
doing. One that stops a daemon must take locks (logging's, a `threading.Event`'s), and the main
thread may hold the very lock: `Event.set()` from a handler that interrupts `Event.wait()` on the
same event waits forever, a daemon that never exits (CI saw `swarm-peer` outlive its 15 s). So a
daemon takes these signals on a thread of its own with `sigwait`, whatever the main thread is
doing (waiting, training, stuck in C code), and the threads swarm starts block them, so that in
a notebook Ctrl+C reaches the main thread rather than the peer's loop.
"""

from __future__ import annotations

import _thread
import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def block_stop_signals() -> None:
    """Keeps SIGINT/SIGTERM off the calling thread and the threads it starts, so they reach one
    that handles them. Never applied to the main thread here (a notebook's Ctrl+C goes there)."""
    if hasattr(signal, "pthread_sigmask") and threading.current_thread() is not threading.main_thread():
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def handle_stop_signals(on_signal: Callable[[int], None]) -> None:
    """For a process's entry point, on its main thread: from now on each SIGINT/SIGTERM calls
    `on_signal(signum)` on the thread "swarm-signals", which does nothing else.

    The main thread and every thread started after this block the signals; a process started
    after it inherits the block (so it would not see Ctrl+C): entry points that start processes
    do not call this. Threads that already exist keep their mask; should one take a signal, the
    Python handler installed here passes it on the same way.
    """
    lock = threading.Lock()

    def deliver(signum: int) -> None:
        with lock:
            on_signal(signum)

    def on_main_thread(signum: int, _frame: object) -> None:
        _thread.start_new_thread(deliver, (signum,))  # takes none of threading's locks

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_main_thread)  # also keeps an inherited SIG_IGN from dropping them
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - platforms without POSIX threads' masks
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def wait_for_signals() -> None:
        while True:
            deliver(signal.sigwait(STOP_SIGNALS))

    threading.Thread(target=wait_for_signals, name="swarm-signals", daemon=True).start()
