"""Prometheus metrics of a peer, served by `swarm-peer --metrics-port N` at ``http://host:N/metrics``.

Metrics are prometheus_client's (the library Python exporters use): families live in small
registries (`swarm.metrics.registry`), rendered in the Prometheus text format (0.0.4) by a tiny
HTTP responder on the peer's own event loop (`swarm.metrics.http`).

What a peer's scrape shows (`swarm.cli.metrics`, served by `swarm-peer --metrics-port`):

- ``swarm_peer_info{peer_id,version,role,client_mode}``, ``swarm_peer_start_time_seconds``;
- ``swarm_known_peers{source="dht"|"channels"}`` (the DHT's routing table when the peer has a DHT,
  else its open channels), ``swarm_open_channels``;
- ``swarm_rpc_server_*`` and ``swarm_rpc_client_*``: ``calls_total{method,outcome}``,
  ``latency_seconds{method}`` (histogram), ``received_bytes_total{method}``,
  ``sent_bytes_total{method}``, ``in_flight`` — counted by `swarm.net.server` / `swarm.net.channels`
  in plain numbers that a prometheus_client collector reads at scrape time (`swarm.metrics.rpc`:
  prometheus_client's own types cost the hot path over 2%, BENCHMARKS.md);
- ``swarm_averaging_rounds_total{outcome="succeeded"|"failed"}``,
  ``swarm_expert_batches_total{expert}``, ``swarm_expert_queue_depth{expert}``: declared here,
  updated by `swarm.averaging` and `swarm.moe` (see below);
- ``swarm_moe_rejected_answers_total{direction,reason}``, ``swarm_moe_clipped_rows_total{direction}``
  (a mixture's checks of its experts' answers, `swarm.moe.client.answer_checks`) and
  ``swarm_expert_clipped_grad_rows_total{expert}`` (an expert's bound on its callers' gradients);
- ``process_*`` (CPU seconds, resident memory, open files, start time): prometheus_client's
  `ProcessCollector`, in the process-wide registry.

API for subsystems (averaging, MoE, optim)::

    from swarm.metrics import REGISTRY, AVERAGING_ROUNDS, EXPERT_BATCHES, EXPERT_QUEUE_DEPTH

    AVERAGING_ROUNDS.labels(outcome="succeeded").inc()        # or outcome="failed"
    EXPERT_BATCHES.labels(expert="ffn.0.1").inc()
    EXPERT_QUEUE_DEPTH.labels(expert="ffn.0.1").set_function(lambda: pool.queued_tasks)

    STEPS = REGISTRY.counter("swarm_optim_steps_total", "Optimizer steps taken", ("run",))
    STEPS.labels(run="my-run").inc()
    with REGISTRY.histogram("swarm_optim_step_seconds", "Step duration").time():
        ...

- ``REGISTRY.counter(name, help, labels=())``, ``.gauge(...)``, ``.histogram(..., buckets=...)``
  get or create a family (the same name, kind and labels return the same family).
- Families are prometheus_client's `Counter`, `Histogram` and `Gauge` (swarm's subclass: a
  ``set_function`` probe that raises reads as NaN instead of failing the scrape): ``family.labels(*values)`` /
  ``family.labels(name=value)`` returns a child to bind once and update on the hot path: ``inc()``;
  gauges also ``set()``, ``dec()``, ``set_function(fn)`` (read at scrape time); histograms
  ``observe(seconds)`` and ``time()``. A family without labels takes these calls directly.
- `REGISTRY` is process-wide. `Peer.metrics_registry` is a registry for one peer only (use it
  where one process runs several peers, as simulations do); both are rendered in that peer's
  scrape. A name must live in only one of them.

Nothing here imports prometheus_client until a family is asked for (``REGISTRY.counter(...)``,
``AVERAGING_ROUNDS``, ...) or a registry is rendered, so a DHT-only daemon without
``--metrics-port`` never loads it (BENCHMARKS.md, "Transport security": ~4.5 MB of RSS).

prometheus_client takes a lock per update, so these updates are exact from any thread; the RPC
numbers are updated and read on the peer's event loop only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swarm.metrics.registry import DEFAULT_BUCKETS, Registry
from swarm.metrics.rpc import MethodMetrics, RPCMetrics

if TYPE_CHECKING:
    from prometheus_client import Counter

__all__ = [
    "AVERAGING_ROUNDS", "BULK_CONNECTIONS", "DEFAULT_BUCKETS", "EXPERT_BATCHES", "EXPERT_CLIPPED_GRAD_ROWS",
    "EXPERT_QUEUE_DEPTH", "MOE_CLIPPED_ROWS", "MOE_REJECTED_ANSWERS", "REGISTRY", "Counter", "Gauge", "Histogram",
    "MethodMetrics", "RPCMetrics", "Registry",
]


def _declare(registry: Registry) -> None:
    """What the process-wide registry holds from the start (run when prometheus_client is loaded)."""
    from prometheus_client import ProcessCollector

    registry.register(ProcessCollector(registry=None))
    for make in _FAMILIES.values():
        make()


REGISTRY = Registry(_declare)
"""Process-wide metrics, rendered in the scrape of every peer of the process."""


def _averaging_rounds() -> Counter:
    family = REGISTRY.counter(
        "swarm_averaging_rounds_total", "Averaging rounds this process took part in, by outcome", ("outcome",))
    for outcome in ("succeeded", "failed"):
        family.labels(outcome)  # both series exist (at 0) before the first round
    return family


def _bulk_connections() -> Counter:
    family = REGISTRY.counter(
        "swarm_bulk_connections_total", "Bulk streams this peer started, by how: on a connection it kept from an "
        "earlier stream to the same peer (reused), or on one it dialed (dialed)", ("how",))
    for how in ("reused", "dialed"):
        family.labels(how)
    return family


_FAMILIES = {
    "AVERAGING_ROUNDS": _averaging_rounds,
    "BULK_CONNECTIONS": _bulk_connections,
    "EXPERT_BATCHES": lambda: REGISTRY.counter(
        "swarm_expert_batches_total", "Batches an expert processed (forward or backward)", ("expert",)),
    "EXPERT_QUEUE_DEPTH": lambda: REGISTRY.gauge(
        "swarm_expert_queue_depth", "Tasks waiting in an expert's queue", ("expert",)),
    "MOE_REJECTED_ANSWERS": lambda: REGISTRY.counter(
        "swarm_moe_rejected_answers_total", "Expert answers a mixture rejected (the expert failed for the batch), "
        "by direction and reason (not_finite, shape, magnitude)", ("direction", "reason")),
    "MOE_CLIPPED_ROWS": lambda: REGISTRY.counter(
        "swarm_moe_clipped_rows_total", "Rows of expert answers a mixture scaled down to its bound", ("direction",)),
    "EXPERT_CLIPPED_GRAD_ROWS": lambda: REGISTRY.counter(
        "swarm_expert_clipped_grad_rows_total", "Gradient rows callers sent that an expert scaled down to its bound "
        "before training on them", ("expert",)),
}


def __getattr__(name: str) -> Any:
    """The declared families and prometheus_client's classes, made (and imported) on first use."""
    if name in _FAMILIES:
        family = globals()[name] = _FAMILIES[name]()
        return family
    if name in ("Counter", "Gauge", "Histogram"):
        from swarm.metrics import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
