"""Metric families (counter, gauge, histogram) and their Prometheus text exposition (format 0.0.4).

Pure bookkeeping: no sockets, no threads, no locks. An update is a few attribute increments, cheap
enough for the RPC hot path. Updates are exact when made from one thread (the peer's event loop);
from several threads at once an increment can, very rarely, be lost — acceptable for metrics, and
the price of keeping locks off the hot path.
"""

from __future__ import annotations

import math
import re
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, Self, TypeVar

__all__ = ["DEFAULT_BUCKETS", "Counter", "Gauge", "Histogram", "Registry"]

DEFAULT_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
"""Latency buckets in seconds: from a loopback RPC (~0.5 ms) to a slow averaging round."""

_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape_label(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _call(function: Callable[[], float]) -> float:
    try:
        return float(function())
    except Exception:  # noqa: BLE001 - a broken probe must not break the whole scrape
        return math.nan


class _CounterChild:
    __slots__ = ("_function", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self._function: Callable[[], float] | None = None

    def inc(self, amount: float = 1.0) -> None:
        """Adds `amount` (not negative: a counter only goes up)."""
        if amount < 0:
            raise ValueError(f"a counter only goes up; cannot add {amount}")
        self.value += amount

    def set_function(self, function: Callable[[], float] | None) -> None:
        """Reads the total from `function()` at each scrape instead (a total kept elsewhere)."""
        self._function = function

    def get(self) -> float:
        return self.value if self._function is None else _call(self._function)


class _GaugeChild:
    __slots__ = ("_function", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self._function: Callable[[], float] | None = None

    def set(self, value: float) -> None:
        self.value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set_function(self, function: Callable[[], float] | None) -> None:
        """Reads the value from `function()` at each scrape instead (e.g. a queue's length)."""
        self._function = function

    def get(self) -> float:
        return self.value if self._function is None else _call(self._function)


class _Timer:
    __slots__ = ("_child", "_start")

    def __init__(self, child: _HistogramChild) -> None:
        self._child = child
        self._start = 0.0

    def __enter__(self) -> Self:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._child.observe(time.perf_counter() - self._start)


class _HistogramChild:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def time(self) -> _Timer:
        """`with histogram.time(): ...` observes the block's duration in seconds."""
        return _Timer(self)


ChildT = TypeVar("ChildT", _CounterChild, _GaugeChild, _HistogramChild)


class _Metric(Generic[ChildT]):
    """A metric family: one child per combination of label values (just one without labels)."""

    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(f"invalid metric name {name!r}: use [a-zA-Z_:][a-zA-Z0-9_:]*")
        if isinstance(labels, str):
            raise TypeError(f"labels of {name} must be a sequence of names, not the string {labels!r}")
        labels = tuple(labels)
        for label in labels:
            if not isinstance(label, str) or not _LABEL_RE.fullmatch(label) or label.startswith("__"):
                raise ValueError(f"invalid label name {label!r} for metric {name}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"metric {name} repeats a label name: {labels}")
        self.name = name
        self.help = help
        self.label_names = labels
        self._children: dict[tuple[str, ...], ChildT] = {}
        if not labels:
            self._children[()] = self._new_child()

    def _new_child(self) -> ChildT:
        raise NotImplementedError

    def labels(self, *values: object, **by_name: object) -> ChildT:
        """The child for these label values, by position or by name; created on first use.

        Bind a child once (``calls = CALLS.labels(method="Find")``) and update it on the hot path.
        """
        if by_name:
            if values:
                raise TypeError(f"{self.name}.labels(): pass label values by position or by name, not both")
            if set(by_name) != set(self.label_names):
                raise ValueError(f"{self.name} has labels {self.label_names}, got {tuple(by_name)}")
            values = tuple(by_name[n] for n in self.label_names)
        if len(values) != len(self.label_names):
            raise ValueError(f"{self.name} has labels {self.label_names}, got {len(values)} value(s)")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children.setdefault(key, self._new_child())
        return child

    def remove(self, *values: object) -> None:
        """Forgets one child (e.g. an expert no longer served)."""
        self._children.pop(tuple(str(v) for v in values), None)

    def _only_child(self) -> ChildT:
        if self.label_names:
            raise TypeError(f"{self.name} has labels {self.label_names}: call .labels(...) first")
        return self._children[()]

    def samples(self) -> Iterator[str]:
        raise NotImplementedError

    def render(self) -> str:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        lines.extend(self.samples())
        return "\n".join(lines) + "\n"


ScalarChildT = TypeVar("ScalarChildT", _CounterChild, _GaugeChild)


class _Scalar(_Metric[ScalarChildT]):
    """A family whose children each hold one number (counters and gauges)."""

    def inc(self, amount: float = 1.0) -> None:
        self._only_child().inc(amount)

    def set_function(self, function: Callable[[], float] | None) -> None:
        self._only_child().set_function(function)

    @property
    def value(self) -> float:
        return self._only_child().get()

    def samples(self) -> Iterator[str]:
        for values, child in list(self._children.items()):
            yield f"{self.name}{_label_text(self.label_names, values)} {_format_value(child.get())}"


class Counter(_Scalar[_CounterChild]):
    """A total that only goes up (calls, bytes, rounds). Name it `..._total`."""

    kind = "counter"

    def _new_child(self) -> _CounterChild:
        return _CounterChild()


class Gauge(_Scalar[_GaugeChild]):
    """A value that goes up and down (queue depth, known peers), or is read at scrape time."""

    kind = "gauge"

    def _new_child(self) -> _GaugeChild:
        return _GaugeChild()

    def set(self, value: float) -> None:
        self._only_child().set(value)

    def dec(self, amount: float = 1.0) -> None:
        self._only_child().dec(amount)


class Histogram(_Metric[_HistogramChild]):
    """Observations counted in buckets (latency, sizes), with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        bounds = tuple(float(b) for b in buckets if not math.isinf(b))
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram {name}: buckets must be increasing, got {tuple(buckets)}")
        if "le" in tuple(labels):
            raise ValueError(f"histogram {name}: 'le' is reserved for bucket bounds")
        self.bounds = bounds
        super().__init__(name, help, labels)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self.bounds)

    def observe(self, value: float) -> None:
        self._only_child().observe(value)

    def time(self) -> _Timer:
        return self._only_child().time()

    def samples(self) -> Iterator[str]:
        for values, child in list(self._children.items()):
            cumulative = 0
            counts = list(child.counts)
            for bound, count in zip((*self.bounds, math.inf), counts):
                cumulative += count
                le = f'le="{_format_value(bound)}"'
                yield f"{self.name}_bucket{_label_text(self.label_names, values, le)} {cumulative}"
            labels = _label_text(self.label_names, values)
            yield f"{self.name}_sum{labels} {_format_value(child.sum)}"
            yield f"{self.name}_count{labels} {cumulative}"


MetricT = TypeVar("MetricT", Counter, Gauge, Histogram)


class Registry:
    """A set of metric families with unique names, rendered together for one scrape.

    `counter`, `gauge` and `histogram` get or create: asking twice for the same name, kind and
    labels returns the same family (so module reloads and per-instance code are safe); a clash
    in kind or labels is a `ValueError`.
    """

    def __init__(self) -> None:
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}

    def _get_or_create(self, cls: type[MetricT], name: str, factory: Callable[[], MetricT],
                       labels: Sequence[str]) -> MetricT:
        existing = self._metrics.get(name)
        if existing is None:
            metric = factory()
            return self._metrics.setdefault(name, metric)  # type: ignore[return-value]
        if type(existing) is not cls or existing.label_names != tuple(labels):
            raise ValueError(
                f"metric {name} already exists as a {existing.kind} with labels {existing.label_names}"
            )
        return existing  # type: ignore[return-value]

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        """A counter family; `labels` names its label dimensions (e.g. ``("method",)``)."""
        return self._get_or_create(Counter, name, lambda: Counter(name, help, labels), labels)

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        """A gauge family; `labels` names its label dimensions."""
        return self._get_or_create(Gauge, name, lambda: Gauge(name, help, labels), labels)

    def histogram(self, name: str, help: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = DEFAULT_BUCKETS) -> Histogram:
        """A histogram family with the given bucket upper bounds (+Inf is implied)."""
        return self._get_or_create(Histogram, name, lambda: Histogram(name, help, labels, buckets), labels)

    def get(self, name: str) -> Counter | Gauge | Histogram | None:
        return self._metrics.get(name)

    def unregister(self, name: str) -> None:
        self._metrics.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._metrics

    def __iter__(self) -> Iterator[Counter | Gauge | Histogram]:
        return iter(list(self._metrics.values()))

    def render(self) -> str:
        """The Prometheus text exposition of every family, in registration order."""
        return "".join(metric.render() for metric in self)
