"""Metric families (prometheus_client's) in swarm's registries, and their text exposition, without sockets."""

import math

import pytest

from swarm.metrics import AVERAGING_ROUNDS, REGISTRY, Registry, RPCMetrics


def test_counter_gauge_histogram_render_in_text_format(parse):
    reg = Registry()
    calls = reg.counter("x_calls_total", "Calls", ("method",))
    calls.labels("a").inc()
    calls.labels(method="a").inc(2)
    calls.labels("b").inc()
    depth = reg.gauge("x_depth", "Queue depth")
    depth.set(3)
    depth.dec()
    latency = reg.histogram("x_seconds", "Latency", buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 7.0):
        latency.observe(v)
    text = reg.render()
    assert "# HELP x_calls_total Calls\n# TYPE x_calls_total counter\n" in text
    assert "# TYPE x_seconds histogram" in text
    s = parse(text)
    assert s[("x_calls_total", (("method", "a"),))] == 3 and s[("x_calls_total", (("method", "b"),))] == 1
    assert s[("x_depth", ())] == 2
    assert s[("x_seconds_bucket", (("le", "0.1"),))] == 2  # le is inclusive
    assert s[("x_seconds_bucket", (("le", "1.0"),))] == 3
    assert s[("x_seconds_bucket", (("le", "+Inf"),))] == 4 == s[("x_seconds_count", ())]
    assert s[("x_seconds_sum", ())] == pytest.approx(7.65)


def test_label_values_and_help_are_escaped():
    reg = Registry()
    reg.counter("x_total", "line one\nline \\ two", ("v",)).labels('say "hi"\\\n').inc()
    text = reg.render()
    assert "# HELP x_total line one\\nline \\\\ two\n" in text
    assert 'x_total{v="say \\"hi\\"\\\\\\n"} 1.0\n' in text


def test_get_or_create_returns_the_same_family_and_refuses_clashes():
    reg = Registry()
    a = reg.counter("x_total", "X", ("k",))
    assert reg.counter("x_total", "X", ("k",)) is a
    with pytest.raises(ValueError, match="already exists as a counter"):
        reg.gauge("x_total", "X", ("k",))
    with pytest.raises(ValueError, match="already exists"):
        reg.counter("x_total", "X", ("other",))
    reg.unregister("x_total")
    assert "x_total" not in reg and "x_total" not in reg.render()
    assert reg.gauge("x_total", "now a gauge") is not a


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda r: r.counter("bad name", "x"), "invalid metric name"),
        (lambda r: r.counter("x_total", "x", ("__reserved",)), "(?i)reserved label"),
        (lambda r: r.counter("x_total", "x", "method"), "not the string"),
        (lambda r: r.histogram("x", "x", ("le",)), "(?i)reserved label"),
        (lambda r: r.histogram("x", "x", buckets=(1.0, 0.5)), "sorted"),
    ],
)
def test_bad_definitions_are_clear_errors(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make(Registry())


def test_misuse_of_labels_is_a_clear_error():
    reg = Registry()
    labeled = reg.counter("x_total", "X", ("method",))
    with pytest.raises(ValueError, match="missing label values"):
        labeled.inc()
    with pytest.raises(ValueError, match="label count"):
        labeled.labels("a", "b")
    with pytest.raises(ValueError, match="label names"):
        labeled.labels(other="a")
    with pytest.raises(ValueError, match="non-negative"):
        labeled.labels("a").inc(-1)


def test_functions_are_read_at_scrape_time_and_failures_show_as_nan(parse):
    reg = Registry()
    queue = [1, 2]
    reg.gauge("x_queue", "Q").set_function(lambda: len(queue))
    reg.gauge("x_broken", "B", ("k",)).labels("v").set_function(lambda: 1 / 0)
    queue.append(3)
    s = parse(reg.render())
    assert s[("x_queue", ())] == 3 and math.isnan(s[("x_broken", (("k", "v"),))])


def test_histogram_timer_observes_the_block(parse):
    reg = Registry()
    h = reg.histogram("x_seconds", "T")
    with h.time():
        pass
    assert parse(reg.render())[("x_seconds_count", ())] == 1


def test_rpc_metrics_count_calls_outcomes_bytes_and_in_flight(parse):
    rpc = RPCMetrics("server")
    m = rpc.method("/swarm.Peer/Info")
    assert rpc.method("/swarm.Peer/Info") is m
    started = m.start()
    assert parse(rpc.registry.render())[("swarm_rpc_server_in_flight", ())] == 1
    m.received.inc(10)
    m.sent.value += 7  # how swarm.net counts payload bytes on the hot path
    m.sent.value += 5
    m.finish(started, ok=True)
    m.finish(m.start(), ok=False)
    s = parse(rpc.registry.render())
    method = ("method", "/swarm.Peer/Info")
    assert s[("swarm_rpc_server_calls_total", (method, ("outcome", "ok")))] == 1
    assert s[("swarm_rpc_server_calls_total", (method, ("outcome", "error")))] == 1
    assert s[("swarm_rpc_server_latency_seconds_count", (method,))] == 2
    assert s[("swarm_rpc_server_received_bytes_total", (method,))] == 10
    assert s[("swarm_rpc_server_sent_bytes_total", (method,))] == 12 == m.sent.value
    assert s[("swarm_rpc_server_in_flight", ())] == 0
    with pytest.raises(ValueError, match="non-negative"):
        m.sent.value = 3  # a byte count never goes down
    assert m.sent.value == 12


def test_process_wide_and_per_peer_registries(parse):
    s = parse(REGISTRY.render())
    assert ("swarm_averaging_rounds_total", (("outcome", "failed"),)) in s
    assert s[("process_resident_memory_bytes", ())] > 0  # prometheus_client's ProcessCollector
    assert AVERAGING_ROUNDS.labels(outcome="succeeded") is AVERAGING_ROUNDS.labels("succeeded")
