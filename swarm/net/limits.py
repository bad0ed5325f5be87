"""What one source network and one caller may use of a server at once: the limiter every call passes.

Identities cost nothing, so a limit per caller (PeerID) alone holds back nobody who brings many;
the server therefore names each call's *source* too, the network it came from
(`swarm.net.server.source_of`: an IPv4 /24 or IPv6 /64; "" for an exempt one such as loopback),
and `CallLimiter` counts both. Every call the server runs is admitted here first:

- calls in flight at once from one source and from one caller, over all methods (the server's
  `ServerConfig.max_inflight_per_source` / `max_inflight_per_caller`), so no one host or identity
  takes all of gRPC's `max_concurrent_rpcs` slots;
- and, for methods registered with a `CallLimit` (the DHT's Store and Find, the averaging
  streams), calls in flight of that group per source and per caller, and calls started per second
  per source (a token bucket), so a flood from one network is refused with RESOURCE_EXHAUSTED
  before its handler runs while other networks are served.

A refusal names the limit it hit ("... the server's limit per source address"), so the caller
knows why. Pure bookkeeping, no networking: `tests/net/test_limits.py` checks it without sockets;
`tests/security/test_server_source_limits.py` runs the attack with real peers in a namespace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from swarm.core.errors import ConfigError, ResourceExhausted

__all__ = ["CallLimit", "CallLimiter"]

_MAX_BUCKETS = 4096  # token buckets kept per group before the full ones are forgotten


@dataclass(frozen=True)
class CallLimit:
    """Limits on one group of methods (several methods may share a group by sharing its name).

    Attributes:
        group: What the methods are, as refusals show it ("DHT stores").
        per_source: Calls of the group in flight at once from one source network; None: no limit.
        per_caller: Calls of the group in flight at once from one caller (PeerID); None: no limit.
        rate_per_source: Calls of the group one source network may start per second, sustained;
            None: no limit.
        burst_per_source: Calls a source may start at once beyond the sustained rate (the token
            bucket's size); 0: twice the rate (at least 1).
    """

    group: str
    per_source: int | None = None
    per_caller: int | None = None
    rate_per_source: float | None = None
    burst_per_source: int = 0

    def __post_init__(self) -> None:
        for name in ("per_source", "per_caller"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"CallLimit.{name} must be >= 1 or None, got {value}")
        if self.rate_per_source is not None and not self.rate_per_source > 0:
            raise ConfigError(f"CallLimit.rate_per_source must be > 0 or None, got {self.rate_per_source}")
        if self.burst_per_source < 0:
            raise ConfigError(f"CallLimit.burst_per_source must be >= 0, got {self.burst_per_source}")
        if self.rate_per_source is not None and self.burst_per_source == 0:
            object.__setattr__(self, "burst_per_source", max(1, int(2 * self.rate_per_source)))


class CallLimiter:
    """Counts the calls a server runs, by source network and by caller, and refuses what is past a limit.

    Args:
        per_source: Calls in flight at once from one source network, over all methods.
        per_caller: Calls in flight at once from one caller, over all methods.
        clock: Time source of the rate limits.
    """

    def __init__(self, per_source: int, per_caller: int, clock: Callable[[], float] = time.monotonic) -> None:
        if per_source < 1 or per_caller < 1:
            raise ConfigError("the limits per source and per caller must be positive")
        self.per_source = per_source
        self.per_caller = per_caller
        self._clock = clock
        self.by_source: dict[str, int] = {}
        """Calls in flight per source network (exempt sources are not counted)."""
        self.by_caller: dict[str, int] = {}
        """Calls in flight per caller."""
        self._grouped: dict[tuple[str, str], int] = {}  # (group, "s" + source | "c" + caller) -> in flight
        self._buckets: dict[tuple[str, str], list[float]] = {}  # (group, source) -> [tokens, when]
        self.refused: dict[str, int] = {}
        """Calls refused, by the limit that refused them (for metrics and tests)."""

    def admit(self, limit: CallLimit | None, caller: str, source: str) -> None:
        """Takes a slot for one call; `release` with the same arguments gives it back.

        Raises:
            ResourceExhausted: a limit is reached (nothing is taken then).
        """
        from_source = self.by_source.get(source, 0) if source else 0
        if from_source >= self.per_source:
            self._refuse("source", f"{from_source} calls in flight from your network {source}, "
                                   f"the server's limit per source address; retry later")
        from_caller = self.by_caller.get(caller, 0) if caller else 0
        if from_caller >= self.per_caller:
            self._refuse("caller", f"{from_caller} calls in flight from you, the server's limit per caller; retry later")
        if limit is not None:
            self._admit_group(limit, caller, source)
        if source:
            self.by_source[source] = from_source + 1
        if caller:
            self.by_caller[caller] = from_caller + 1

    def _admit_group(self, limit: CallLimit, caller: str, source: str) -> None:
        group, grouped = limit.group, self._grouped
        if source and limit.per_source is not None and grouped.get((group, "s" + source), 0) >= limit.per_source:
            self._refuse(f"{group} source", f"{limit.per_source} {group} in flight from your network {source}, "
                                            f"the server's limit per source address; retry later")
        if caller and limit.per_caller is not None and grouped.get((group, "c" + caller), 0) >= limit.per_caller:
            self._refuse(f"{group} caller", f"{limit.per_caller} {group} in flight from you, "
                                            f"the server's limit per caller; retry later")
        if source and limit.rate_per_source is not None:
            self._take_token(limit, source)
        if source and limit.per_source is not None:
            grouped[(group, "s" + source)] = grouped.get((group, "s" + source), 0) + 1
        if caller and limit.per_caller is not None:
            grouped[(group, "c" + caller)] = grouped.get((group, "c" + caller), 0) + 1

    def _take_token(self, limit: CallLimit, source: str) -> None:
        rate, burst = float(limit.rate_per_source or 0.0), float(limit.burst_per_source)
        now = self._clock()
        key = (limit.group, source)
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= _MAX_BUCKETS:
                self._forget_full_buckets(now)
            bucket = self._buckets[key] = [burst, now, rate, burst]
        tokens = min(burst, bucket[0] + (now - bucket[1]) * rate)
        bucket[1] = now
        if tokens < 1.0:
            bucket[0] = tokens
            self._refuse(f"{limit.group} rate", f"your network {source} sends more than {rate:g} {limit.group} "
                                               f"per second, the server's limit per source address; retry later")
        bucket[0] = tokens - 1.0

    def _forget_full_buckets(self, now: float) -> None:
        """Drops the buckets that have refilled (forgetting them changes nothing); all if none has."""
        for key, (tokens, when, rate, burst) in list(self._buckets.items()):
            if tokens + (now - when) * rate >= burst:
                del self._buckets[key]
        if len(self._buckets) >= _MAX_BUCKETS:
            self._buckets.clear()

    def release(self, limit: CallLimit | None, caller: str, source: str) -> None:
        """Gives back the slot `admit` took for one call."""
        if source:
            _decrement(self.by_source, source)
        if caller:
            _decrement(self.by_caller, caller)
        if limit is not None:
            if source and limit.per_source is not None:
                _decrement(self._grouped, (limit.group, "s" + source))
            if caller and limit.per_caller is not None:
                _decrement(self._grouped, (limit.group, "c" + caller))

    def in_flight(self, group: str, *, source: str = "", caller: str = "") -> int:
        """Calls of `group` in flight from `source` (or from `caller`)."""
        return self._grouped.get((group, "s" + source if source else "c" + caller), 0)

    def _refuse(self, which: str, message: str) -> None:
        self.refused[which] = self.refused.get(which, 0) + 1
        raise ResourceExhausted(message)


def _decrement(counts: dict, key: object) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
