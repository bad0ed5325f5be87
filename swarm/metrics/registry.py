"""Metric families through prometheus_client, in small get-or-create registries.

A `Registry` wraps one `prometheus_client.CollectorRegistry`: `counter`, `gauge` and `histogram`
return prometheus_client's own `Counter`, `Gauge` and `Histogram` (so ``.labels(...).inc()``,
``.set_function(fn)``, ``.observe(s)``, ``.time()`` are the library's), and `render` is its text
exposition (format 0.0.4). Asking twice for the same name, kind and labels returns the same
family, so per-instance code and module reloads are safe; a clash is a `ValueError`.

prometheus_client (with the `http.server`, `email` and `wsgiref` modules it imports, ~4.5 MB of a
process's memory) is imported when a registry gets its first family or collector, or is rendered:
a peer that never does (a DHT-only daemon without `--metrics-port`) never loads it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.registry import Collector

__all__ = ["DEFAULT_BUCKETS", "Counter", "Gauge", "Histogram", "Registry", "render"]

DEFAULT_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
"""Latency buckets in seconds: from a loopback RPC (~0.5 ms) to a slow averaging round."""

# Prometheus' classic names: what every Prometheus server accepts (newer ones also take UTF-8).
_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")



_gauge: type[Gauge] | None = None


def _gauge_class() -> type[Gauge]:
    """`Gauge`, made on first use (it subclasses prometheus_client's, which is imported then)."""
    global _gauge
    if _gauge is not None:
        return _gauge
    import prometheus_client

    class Gauge(prometheus_client.Gauge):
        """prometheus_client's gauge, except that a `set_function` probe that raises reads as NaN.

        A probe reads live state (a queue's length, a routing table's size) at scrape time; one that
        fails, e.g. because what it reads has shut down, must not make the whole scrape fail.
        """

        def set_function(self, f: Callable[[], float]) -> None:
            def probe() -> float:
                try:
                    return float(f())
                except Exception:  # noqa: BLE001 - any failure of one probe is that one value's NaN
                    return math.nan

            super().set_function(probe)

    Gauge.__module__, Gauge.__qualname__ = __name__, "Gauge"
    _gauge = Gauge  # type: ignore[assignment]  # the class TYPE_CHECKING describes
    return Gauge  # type: ignore[return-value]


def __getattr__(name: str) -> Any:
    """`Counter`, `Gauge` and `Histogram`: prometheus_client's classes (and swarm's gauge), imported
    on first use."""
    if name in ("Counter", "Histogram"):
        import prometheus_client

        return getattr(prometheus_client, name)
    if name == "Gauge":
        return _gauge_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from prometheus_client import Gauge as _PrometheusGauge

    class Gauge(_PrometheusGauge):  # what `_gauge_class` makes
        def set_function(self, f: Callable[[], float]) -> None: ...


MetricT = TypeVar("MetricT", "Counter", "Gauge", "Histogram")


class Registry:
    """A set of metric families with unique names, rendered together for one scrape."""

    def __init__(self, setup: Callable[[Registry], None] | None = None) -> None:
        self._collectors: CollectorRegistry | None = None
        self._setup = setup  # run once the prometheus_client registry exists (e.g. adds collectors)
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}

    @property
    def collectors(self) -> CollectorRegistry:
        """The prometheus_client registry, made (and prometheus_client imported) on first use."""
        if self._collectors is None:
            from prometheus_client import CollectorRegistry

            self._collectors = CollectorRegistry(auto_describe=True)
            if self._setup is not None:
                self._setup(self)
        return self._collectors

    def _get_or_create(self, cls: type[MetricT], name: str, help: str, labels: Sequence[str],
                       **kwargs: Any) -> MetricT:
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(f"invalid metric name {name!r}: use [a-zA-Z_:][a-zA-Z0-9_:]*")
        if isinstance(labels, str):
            raise TypeError(f"labels of {name} must be a sequence of names, not the string {labels!r}")
        labels = tuple(labels)
        collectors = self.collectors  # first: its setup may declare this very family
        existing = self._metrics.get(name)
        if existing is None:
            metric = cls(name, help, labels, registry=collectors, **kwargs)
            return self._metrics.setdefault(name, metric)  # type: ignore[return-value]
        if type(existing) is not cls or tuple(existing._labelnames) != labels:
            raise ValueError(f"metric {name} already exists as a {existing._type} with labels "
                             f"{tuple(existing._labelnames)}")
        return existing  # type: ignore[return-value]

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        """A counter family (name it ``..._total``); `labels` names its label dimensions."""
        import prometheus_client

        return self._get_or_create(prometheus_client.Counter, name, help, labels)

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        """A gauge family; `labels` names its label dimensions."""
        return self._get_or_create(_gauge_class(), name, help, labels)

    def histogram(self, name: str, help: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = DEFAULT_BUCKETS) -> Histogram:
        """A histogram family with the given bucket upper bounds (+Inf is implied)."""
        import prometheus_client

        return self._get_or_create(prometheus_client.Histogram, name, help, labels, buckets=tuple(buckets))

    def register(self, collector: Collector) -> None:
        """Adds any prometheus_client collector (e.g. `ProcessCollector`) to what `render` shows."""
        self.collectors.register(collector)

    def value(self, sample: str, **labels: str) -> float | None:
        """The current value of one sample, e.g. ``value("x_total", method="Find")``; None if absent."""
        return self.collectors.get_sample_value(sample, labels)

    def get(self, name: str) -> Counter | Gauge | Histogram | None:
        return self._metrics.get(name)

    def unregister(self, name: str) -> None:
        metric = self._metrics.pop(name, None)
        if metric is not None:
            self.collectors.unregister(metric)

    def __contains__(self, name: object) -> bool:
        return name in self._metrics

    def __iter__(self) -> Iterator[Counter | Gauge | Histogram]:
        return iter(list(self._metrics.values()))

    def render(self) -> str:
        """The Prometheus text exposition of every family, in registration order."""
        return render([self])


class _Chain:
    """Several registries as one collector (what `generate_latest` reads)."""

    def __init__(self, registries: Iterable[Registry | Callable[[], Iterable[object]]]) -> None:
        self.registries = list(registries)

    def collect(self) -> Iterator[object]:
        for registry in self.registries:
            yield from registry.collectors.collect()  # type: ignore[union-attr]


def render(registries: Iterable[Registry]) -> str:
    """The text exposition (0.0.4) of several registries, one after the other."""
    from prometheus_client import generate_latest

    return generate_latest(_Chain(registries)).decode()  # type: ignore[arg-type]
