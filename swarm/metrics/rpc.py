"""Per-method call counts, latency and payload bytes of one side of the gRPC layer.

`swarm.net.server.RPCServer` owns one `RPCMetrics("server")` and `swarm.net.channels.ChannelPool`
one `RPCMetrics("client")`, so several peers in one process keep separate counts. Both bind a
`MethodMetrics` per method once and then only add to plain numbers on the hot path; a scrape reads
them through a prometheus_client collector (`RPCCollector`), which renders them like any other
family. prometheus_client's own `Counter`/`Histogram` (a lock and a bucket scan per update) cost
the hot path several times more: scripts/bench/bench_metrics.py, BENCHMARKS.md.

Updates come from the peer's event loop only, and so does the scrape (swarm.metrics.http), so the
numbers are exact without locks.

Bytes are gRPC message payloads (what swarm serializes), not TCP bytes: HTTP/2 framing, headers
and TLS are not counted.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import TYPE_CHECKING

from swarm.metrics.registry import DEFAULT_BUCKETS, Registry

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["Count", "Latency", "MethodMetrics", "RPCCollector", "RPCMetrics"]


class Count:
    """A number that only goes up: ``count.inc(n)``, or ``count.value += n`` as swarm.net does."""

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value = 0.0

    @property
    def value(self) -> float:
        return self._value

    @value.setter
    def value(self, total: float) -> None:
        if total < self._value:
            raise ValueError(f"a count only goes up (non-negative amounts): {self._value} -> {total}")
        self._value = total

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"a count only goes up (non-negative amounts), got {amount}")
        self._value += amount


class Latency:
    """Durations counted in `DEFAULT_BUCKETS` (per bucket, not cumulative; the last is +Inf), and their sum."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(DEFAULT_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(DEFAULT_BUCKETS, seconds)] += 1  # a bound is inclusive: le
        self.sum += seconds


class MethodMetrics:
    """Bound metrics of one method: `ok` and `failed` calls, `latency`, bytes `received` and `sent`."""

    __slots__ = ("_owner", "failed", "latency", "ok", "received", "sent")

    def __init__(self, owner: RPCMetrics) -> None:
        self._owner = owner
        self.ok = Count()
        self.failed = Count()
        self.latency = Latency()
        self.received = Count()
        self.sent = Count()

    def start(self) -> float:
        """Marks a call as begun; returns its start time for `finish`."""
        self._owner.in_flight += 1
        return time.perf_counter()

    def finish(self, started: float, ok: bool) -> None:
        """Records a call's outcome and latency (seconds since `started`)."""
        self._owner.in_flight -= 1
        self.latency.observe(time.perf_counter() - started)
        (self.ok if ok else self.failed)._value += 1


class RPCCollector:
    """Renders one `RPCMetrics` as prometheus_client metric families at scrape time."""

    def __init__(self, rpc: RPCMetrics) -> None:
        self.rpc = rpc

    def collect(self) -> Iterator[Metric]:
        # prometheus_client only at scrape time (swarm.metrics.registry)
        from prometheus_client.metrics_core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        from prometheus_client.utils import floatToGoString

        rpc, prefix = self.rpc, f"swarm_rpc_{self.rpc.side}"
        who = "this peer served" if rpc.side == "server" else "this peer made"
        calls = CounterMetricFamily(f"{prefix}_calls", f"RPCs {who}, by method and outcome (ok or error)",
                                    labels=("method", "outcome"))
        latency = HistogramMetricFamily(f"{prefix}_latency_seconds",
                                        f"Duration of RPCs {who} (whole stream for streaming calls)", labels=("method",))
        received = CounterMetricFamily(f"{prefix}_received_bytes", "gRPC message payload bytes received, by method",
                                       labels=("method",))
        sent = CounterMetricFamily(f"{prefix}_sent_bytes", "gRPC message payload bytes sent, by method",
                                   labels=("method",))
        for path, m in list(rpc.methods.items()):
            calls.add_metric((path, "ok"), m.ok.value)
            calls.add_metric((path, "error"), m.failed.value)
            cumulative, buckets = 0, []
            for bound, count in zip((*DEFAULT_BUCKETS, float("inf")), list(m.latency.counts)):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            latency.add_metric((path,), buckets, m.latency.sum)
            received.add_metric((path,), m.received.value)
            sent.add_metric((path,), m.sent.value)
        yield calls
        yield latency
        yield received
        yield sent
        yield GaugeMetricFamily(f"{prefix}_in_flight", f"RPCs {who} that are still running", value=rpc.in_flight)


class RPCMetrics:
    """Metrics of every method one gRPC server (``side="server"``) or client pool handles."""

    def __init__(self, side: str) -> None:
        if side not in ("server", "client"):
            raise ValueError(f"side is 'server' or 'client', got {side!r}")
        self.side = side
        self.in_flight = 0
        self.methods: dict[str, MethodMetrics] = {}
        self.registry = Registry(lambda registry: registry.register(RPCCollector(self)))

    def method(self, path: str) -> MethodMetrics:
        """The bound metrics of `path` (e.g. ``/swarm.Peer/Info``), created on first use."""
        metrics = self.methods.get(path)
        if metrics is None:
            metrics = self.methods.setdefault(path, MethodMetrics(self))
        return metrics
