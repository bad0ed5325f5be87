"""A blacklist of silent peers: peers that failed to answer, banned for growing periods.

Pure data, no networking: the protocol layer reports each peer that did not answer (or did) and
skips the banned ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Blacklist:
    """Peers that failed to answer, banned for exponentially growing periods.

    The n-th consecutive failure bans a peer for `base_time * backoff_rate ** (n - 1)`
    seconds (capped at `max_time`). Failures reported while a peer is already banned do not
    count again: many calls failing in one outage are one failure. A success clears the peer,
    and so does staying unreported for `max_time` after a ban ends.

    Args:
        base_time: Ban after the first failure, in seconds.
        backoff_rate: Factor by which each further failure lengthens the ban.
        max_time: Longest ban, in seconds.
        clock: Time source.
    """

    _PRUNE_AT = 4096  # entries before long-expired ones are dropped

    def __init__(
        self,
        base_time: float = 5.0,
        backoff_rate: float = 2.0,
        max_time: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if base_time <= 0 or backoff_rate < 1 or max_time < base_time:
            raise ValueError(
                f"need base_time > 0, backoff_rate >= 1, max_time >= base_time; got "
                f"{base_time}, {backoff_rate}, {max_time}"
            )
        self.base_time = base_time
        self.backoff_rate = backoff_rate
        self.max_time = max_time
        self._clock = clock
        self._failures: dict[str, int] = {}
        self._banned_until: dict[str, float] = {}

    def register_failure(self, peer_id: str) -> None:
        """Records that `peer_id` did not answer; bans it (longer each time)."""
        now = self._clock()
        until = self._banned_until.get(peer_id)
        if until is not None and until > now:
            return
        if until is not None and now - until > self.max_time:
            self._failures.pop(peer_id, None)  # quiet for long: start over from base_time
        if len(self._banned_until) > self._PRUNE_AT:
            self._forget_stale(now)
        failures = self._failures.get(peer_id, 0) + 1
        self._failures[peer_id] = failures
        try:
            ban = min(self.base_time * self.backoff_rate ** (failures - 1), self.max_time)
        except OverflowError:
            ban = self.max_time
        self._banned_until[peer_id] = now + ban

    def _forget_stale(self, now: float) -> None:
        for peer_id, until in list(self._banned_until.items()):
            if now - until > self.max_time:
                del self._banned_until[peer_id]
                self._failures.pop(peer_id, None)

    def register_success(self, peer_id: str) -> None:
        """Records that `peer_id` answered: forgets its failures."""
        self._failures.pop(peer_id, None)
        self._banned_until.pop(peer_id, None)

    def is_banned(self, peer_id: str) -> bool:
        return self._banned_until.get(peer_id, float("-inf")) > self._clock()

    def banned_until(self, peer_id: str) -> float | None:
        """When the current ban of `peer_id` ends, or None if it is not banned."""
        until = self._banned_until.get(peer_id)
        return until if until is not None and until > self._clock() else None

    def clear(self) -> None:
        self._failures.clear()
        self._banned_until.clear()

    def __contains__(self, peer_id: object) -> bool:
        return isinstance(peer_id, str) and self.is_banned(peer_id)

    def __len__(self) -> int:
        """Number of peers banned right now."""
        now = self._clock()
        return sum(1 for until in self._banned_until.values() if until > now)
