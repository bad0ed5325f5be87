"""Per-method call counts, latency and payload bytes of one side of the gRPC layer.

`swarm.net.server.RPCServer` owns one `RPCMetrics("server")` and `swarm.net.channels.ChannelPool`
one `RPCMetrics("client")`, so several peers in one process keep separate counts. Both bind a
`MethodMetrics` per method once; on the hot path a call costs prometheus_client's `inc`/`observe`
on children bound in advance (BENCHMARKS.md, "Metrics on the RPC hot path").

Bytes are gRPC message payloads (what swarm serializes), not TCP bytes: HTTP/2 framing, headers
and TLS are not counted.
"""

from __future__ import annotations

import time

from prometheus_client import Counter

from swarm.metrics.registry import Registry

__all__ = ["ByteCount", "MethodMetrics", "RPCMetrics"]

CounterChild = Counter  # `Counter.labels(...)` returns a Counter (prometheus_client's children are its class)


class ByteCount:
    """A byte counter bound to one method: ``count.inc(n)``, or ``count.value += n`` as swarm.net does.

    `value` is what this object has counted; assigning a larger value adds the difference to the
    prometheus_client counter behind it (a counter never goes down: a smaller value is refused).
    """

    __slots__ = ("_child", "_value")

    def __init__(self, child: CounterChild) -> None:
        self._child = child
        self._value = 0.0

    @property
    def value(self) -> float:
        return self._value

    @value.setter
    def value(self, total: float) -> None:
        self.inc(total - self._value)

    def inc(self, amount: float = 1.0) -> None:
        self._child.inc(amount)  # refuses a negative amount with a ValueError
        self._value += amount


class MethodMetrics:
    """Bound metrics of one method: `ok` and `failed` calls, `latency`, bytes `received` and `sent`."""

    __slots__ = ("_in_flight", "failed", "latency", "ok", "received", "sent")

    def __init__(self, owner: RPCMetrics, method: str) -> None:
        self.ok = owner.calls.labels(method, "ok")
        self.failed = owner.calls.labels(method, "error")
        self.latency = owner.latency.labels(method)
        self.received = ByteCount(owner.received_bytes.labels(method))
        self.sent = ByteCount(owner.sent_bytes.labels(method))
        self._in_flight = owner.in_flight

    def start(self) -> float:
        """Marks a call as begun; returns its start time for `finish`."""
        self._in_flight.inc()
        return time.perf_counter()

    def finish(self, started: float, ok: bool) -> None:
        """Records a call's outcome and latency (seconds since `started`)."""
        self._in_flight.dec()
        self.latency.observe(time.perf_counter() - started)
        (self.ok if ok else self.failed).inc()


class RPCMetrics:
    """Metrics of every method one gRPC server (``side="server"``) or client pool handles."""

    def __init__(self, side: str) -> None:
        if side not in ("server", "client"):
            raise ValueError(f"side is 'server' or 'client', got {side!r}")
        self.side = side
        self.registry = Registry()
        prefix = f"swarm_rpc_{side}"
        who = "this peer served" if side == "server" else "this peer made"
        self.calls = self.registry.counter(
            f"{prefix}_calls_total", f"RPCs {who}, by method and outcome (ok or error)", ("method", "outcome"))
        self.latency = self.registry.histogram(
            f"{prefix}_latency_seconds", f"Duration of RPCs {who} (whole stream for streaming calls)", ("method",))
        self.received_bytes = self.registry.counter(
            f"{prefix}_received_bytes_total", "gRPC message payload bytes received, by method", ("method",))
        self.sent_bytes = self.registry.counter(
            f"{prefix}_sent_bytes_total", "gRPC message payload bytes sent, by method", ("method",))
        self.in_flight = self.registry.gauge(f"{prefix}_in_flight", f"RPCs {who} that are still running")
        self._methods: dict[str, MethodMetrics] = {}

    def method(self, path: str) -> MethodMetrics:
        """The bound metrics of `path` (e.g. ``/swarm.Peer/Info``), created on first use."""
        metrics = self._methods.get(path)
        if metrics is None:
            metrics = self._methods.setdefault(path, MethodMetrics(self, path))
        return metrics
