"""Python's cyclic garbage collector, kept from stalling a peer's rounds.

A full (generation 2) collection visits every object the collector tracks, holding the GIL
throughout. In a trainer process that is ~300,000 objects, nearly all from imports (torch, grpc)
and alive until the process ends. Measured in four 9.5M-parameter trainers on two busy cores, each
full collection stopped a trainer's event loop for 0.16–0.41 s, once or twice a minute, and the
processes reached theirs within seconds of each other; one that struck the reducer of a round's
part held the round past its deadline and the whole group failed it (benchmarks/history/BENCHMARKS-2026-12-05.md,
"Communication overlapped with compute").

`gc.freeze()` moves the objects alive at that moment into a permanent generation that collections
skip, so later full collections visit only what was made since. Applied once per process, by the
first averaging service (the part of a peer whose rounds have deadlines; `swarm.core.malloc` is
applied there for a like reason), after one collection, so that garbage alive then is freed first
rather than kept. Objects frozen here that later become unreachable are freed by reference
counting as usual; only reference cycles among them stay until `gc.unfreeze()`.

Such cycles hold gRPC objects: a call stream open when the freeze ran, closed later, stays in a
cycle through its cancelled reader task (task, its CancelledError, the traceback's frames, the
stream). So do plain cycles that no collection reached before the process ends. Left to the
interpreter's finalization, freeing the last gRPC channel or call shuts down grpc.aio's completion
queue, whose poller thread then takes the GIL while the interpreter finalizes: CPython ends such a
thread inside C++ frames, and the process aborts ("terminate called without an active exception",
seen as a demo trainer's exit status). So the first loop thread of a process registers
`release_at_exit`, which thaws and collects at exit, before finalization begins: gRPC's poller
then stops as in any shutdown (tests/core/test_collector.py).
"""

from __future__ import annotations

import atexit
import gc

_frozen = False
_exit_hook = False


def freeze_long_lived() -> bool:
    """Collects, then freezes every object alive now (`gc.freeze`); True on the process's first
    call, False (doing nothing) after."""
    global _frozen
    if _frozen:
        return False
    _frozen = True
    gc.collect()
    gc.freeze()
    return True


def release_at_exit() -> None:
    """Registers, once per process, a collection at the interpreter's exit that frees every
    unreachable object, the frozen ones included (`atexit`: after the program's own exit hooks
    registered later, before finalization)."""
    global _exit_hook
    if not _exit_hook:
        _exit_hook = True
        atexit.register(_release)


def _release() -> None:
    gc.unfreeze()
    gc.collect()
