"""glibc malloc tuning for peers that move large tensors.

Raising the mmap and trim thresholds cuts CPU per GB and speeds large messages (BENCHMARKS.md,
"Transport facts"), because 1 MiB chunk buffers stop being mmap'ed and unmapped (page faults) on every
message. Applied once per process, by the first part that moves tensors (an averaging service, a
state download, a tensor stream: `swarm.net.streaming`), not at peer start: a peer that moves none,
a DHT-only daemon, would only keep its heap's peak for nothing (~0.5 MB of its memory,
BENCHMARKS.md). A no-op where glibc is absent.
"""

from __future__ import annotations

import ctypes
import logging

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied = False
_tried = False


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Sets glibc's mmap/trim thresholds (like MALLOC_MMAP_THRESHOLD_); True when applied."""
    global _applied, _tried
    if _tried:  # cheap after the first call: the parts that move tensors call it per stream
        return _applied
    _tried = True
    try:
        # the process's own symbols, libc's among them (ctypes.util.find_library would import
        # shutil and tempfile, ~1.2 MB of a daemon's memory, and may run ldconfig to find it)
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    if not ok:
        logging.getLogger(__name__).debug("mallopt refused the thresholds")
    _applied = ok
    return ok
