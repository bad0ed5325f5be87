"""Keeping a member's part streams of the reduce-scatter level with each other.

In the reduce-scatter a member sends one part to each reducer over its own connection: n-1 TCP
flows share its uplink. Left to themselves they do not share it evenly (congestion control is
only roughly fair, and a flow that lost a packet falls behind), so they finish up to a second
apart, and the flows still running take the freed link back only slowly: the phase lasts as
long as its slowest flow, and every reducer's report waits for it (network lab, BENCHMARKS.md
scenario 3). `Lockstep` lets a stream hand its next chunk to its connection only while it is
less than `ahead` chunks ahead of the slowest stream still running, so the flows progress, and
finish, together; the bytes already queued on each connection (`swarm.net.bulk` keeps the
kernel's share of that small) are the only slack left between them. (The same on a reducer's
streams of the mean was measured no faster and is not done.)

A stream that made no progress for its patience (a stalled or very slow peer) stops holding the
others back for the rest of the phase: lockstep never makes a round wait on a peer longer than
the silence limits that would drop that peer anyway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable, Iterable

logger = logging.getLogger(__name__)


class Lockstep:
    """The chunk counts of a set of streams, kept within `ahead` of the slowest one.

    Args:
        streams: the streams' keys; every one must be known before the first chunk goes out, or the
            first stream would run ahead of those not yet known.
        ahead: how many chunks a stream may have sent beyond the slowest running stream before it
            waits (0: no waiting, each stream as fast as its connection takes).
        patience: per key, seconds a stream may go without progress before the others stop waiting
            for it (absent: `default_patience`).
    """

    def __init__(self, streams: Iterable[Hashable], ahead: int, patience: dict[Hashable, float] | None = None,
                 default_patience: float = 1.0) -> None:
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        loop = asyncio.get_running_loop()
        self.ahead = ahead
        self._loop = loop
        self._sent: dict[Hashable, int] = dict.fromkeys(streams, 0)
        self._progress: dict[Hashable, float] = dict.fromkeys(self._sent, loop.time())
        self._patience = {k: (patience or {}).get(k, default_patience) for k in self._sent}
        self._waiters: list[asyncio.Future[None]] = []
        self.waits = 0  # times a stream had to wait for a slower one (tests, diagnostics)

    @property
    def running(self) -> set[Hashable]:
        """The streams still waited for."""
        return set(self._sent)

    def may_send(self, key: Hashable) -> bool:
        """Whether stream `key` may send its next chunk now."""
        mine = self._sent.get(key)
        if self.ahead == 0 or mine is None:
            return True
        return mine - min(self._sent.values()) < self.ahead

    async def turn(self, key: Hashable) -> None:
        """Waits until stream `key` may send its next chunk (a slower stream caught up, finished,
        or went past its patience without progress)."""
        waited = False
        while not self.may_send(key):
            if not waited:
                waited = True
                self.waits += 1
            now = self._loop.time()
            low = min(self._sent.values())
            laggards = [k for k, n in self._sent.items() if n == low]
            stale = [k for k in laggards if now - self._progress[k] >= self._patience[k]]
            if stale:
                for k in stale:
                    logger.debug("lockstep: stream %s silent for %.2f s: no longer waited for", k, now - self._progress[k])
                    self.leave(k)
                continue
            wake = min(self._progress[k] + self._patience[k] for k in laggards)
            # a future of its own, made before anything else runs: a shared event cleared by the
            # next stream to wait could swallow the wake-up meant for this one
            woken = self._loop.create_future()
            self._waiters.append(woken)
            timer = self._loop.call_at(max(now + 0.001, wake), _wake, woken)
            try:
                await woken
            finally:
                timer.cancel()
                if woken in self._waiters:
                    self._waiters.remove(woken)

    def sent(self, key: Hashable) -> None:
        """Stream `key` handed one more chunk to its connection."""
        if key in self._sent:
            self._sent[key] += 1
            self._progress[key] = self._loop.time()
            self._notify()

    def leave(self, key: Hashable) -> None:
        """Stream `key` is done (finished, failed or given up): nobody waits for it any more."""
        if self._sent.pop(key, None) is not None:
            self._notify()

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for woken in waiters:
            _wake(woken)


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
