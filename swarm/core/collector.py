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
"""

from __future__ import annotations

import gc

_frozen = False


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
