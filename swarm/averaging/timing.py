"""How long to wait, learned from what rounds took: a leader's wait for late peers, a round's deadline.

Pure logic, no networking (unit-tested without sockets):

- `ArrivalSpread`: how late the peers that did join arrived, relative to when they said they
  would be ready (their announced readiness, or when the leader first saw their declaration).
  A leader waits for a declared peer up to the largest recent lag (or another quantile) with a
  margin, between a floor and a cap; with nothing observed yet it waits `initial`.
- `RoundTiming`: how long this peer's successful all-reduces took. A leader writes a small
  multiple of the expected time into the group as the round's timeout (between a floor and the
  time the step has left), so a stalled or dead member costs the survivors that multiple, not
  a fixed share of the step's timeout. The expected time is the longer of the window's median and
  the last three rounds' median. A round that failed doubles the next timeout, as TCP backs
  off its retransmission timer (RFC 6298 §5.5), so a link that became slower is followed rather
  than failed on forever; a success resets it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["ArrivalSpread", "RoundTiming", "clamp"]


def clamp(value: float, floor: float, cap: float) -> float:
    """`value` within [floor, cap]; `cap` wins where floor > cap."""
    return max(min(value, cap), min(floor, cap))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class ArrivalSpread:
    """Observed lateness of joiners (seconds), and the wait bound it gives.

    Attributes:
        initial: the bound before anything was observed.
        floor: smallest bound.
        cap: largest bound (a declared peer that never comes costs at most this).
        margin: the bound is `margin` times the `quantile` of recent lags, plus two round trips.
        quantile: which quantile of the lags.
        window: how many recent lags count.
    """

    initial: float = 1.0
    floor: float = 0.05
    cap: float = 5.0
    margin: float = 1.5
    quantile: float = 1.0
    window: int = 64
    lags: deque[float] = field(default_factory=deque)

    def observe(self, lag: float) -> None:
        if not math.isfinite(lag):
            return
        self.lags.append(max(0.0, lag))
        while len(self.lags) > self.window:
            self.lags.popleft()

    def bound(self, rtt: float | None = None) -> float:
        """How long a leader waits for a declared peer past its readiness time."""
        if not self.lags:
            return clamp(self.initial, self.floor, self.cap)
        return clamp(self.margin * _quantile(list(self.lags), self.quantile) + 2 * (rtt or 0.0), self.floor, self.cap)


@dataclass
class RoundTiming:
    """Durations of this peer's successful all-reduces, and the round timeout they give.

    Attributes:
        multiple: the timeout is this many times the expected round time.
        floor: smallest timeout, seconds.
        window: how many recent rounds count (their median is the expected time).
        max_backoff: largest factor failed rounds multiply the timeout by.
    """

    multiple: float = 4.0
    floor: float = 1.0
    window: int = 16
    max_backoff: float = 64.0
    durations: deque[float] = field(default_factory=deque)
    backoff: float = 1.0

    def observe_success(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self.durations.append(seconds)
            while len(self.durations) > self.window:
                self.durations.popleft()
        self.backoff = 1.0

    def observe_failure(self) -> None:
        self.backoff = min(self.max_backoff, 2 * self.backoff)

    def expected(self, estimate: float | None = None) -> float | None:
        """Expected all-reduce time: the median of the window or of the last three rounds, whichever
        is longer (a link that became slower counts after two rounds, a single slow round does
        not), or at least `estimate` (e.g. from link throughput); None when nothing is known."""
        recent = list(self.durations)[-3:]
        measured = max(statistics.median(self.durations), statistics.median(recent)) if self.durations else None
        known = [x for x in (measured, estimate) if x is not None]
        return max(known) if known else None

    def timeout(self, cap: float, estimate: float | None = None) -> float:
        """The round timeout to write into a group: `multiple` x expected x backoff, in [floor, cap]."""
        expected = self.expected(estimate)
        if expected is None:
            return cap
        return clamp(self.multiple * expected * self.backoff, self.floor, cap)
