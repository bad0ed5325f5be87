"""A real Prometheus server (Debian's `prometheus`) scrapes a running peer, and its exposition passes
`promtool check metrics`.

The peer is a `swarm-peer` daemon with `--metrics-port`; another peer calls it, Prometheus scrapes
it on loopback every second, and the test reads the daemon's RPC counter back through
Prometheus' HTTP query API. Skips where the `prometheus` package is not installed
(scripts/test.sh installs it when run as root: scripts/system-packages.txt).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from procs import PeerProcess

from swarm.peer import Peer

from .test_peer_metrics import free_port, scrape

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="needs Debian's prometheus package (prometheus and promtool; scripts/test.sh installs it as root)")
CALLS = 4
T = TypeVar("T")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def wait_until(check: Callable[[], T | None], timeout: float, what: str) -> T:
    """Polls `check()` (an HTTP query of another process) until it returns something, at most `timeout` s."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except OSError as e:  # not listening yet
            value, last_error = None, e
        if value is not None:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout} s (last error: {last_error})")


@pytest.fixture
def daemon() -> Iterator[tuple[PeerProcess, int]]:
    port = free_port()
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-port", str(port), ready_timeout=60) as peer:
        yield peer, port


@pytest.fixture
def prometheus(tmp_path: Path, daemon: tuple[PeerProcess, int]) -> Iterator[str]:
    """A Prometheus server on loopback scraping the daemon every second; yields its base URL."""
    _, target = daemon
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: swarm\n    static_configs:\n      - targets: ['127.0.0.1:{target}']\n")
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: get_json(f"{url}/api/v1/status/buildinfo"), 60, "Prometheus did not start")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(url: str, promql: str) -> list[dict]:
    answer = get_json(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


@needs_prometheus
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_prometheus_scrapes_a_peer_and_its_counter_reads_back(daemon, prometheus: str) -> None:
    peer, _ = daemon
    with Peer(client_mode=True) as caller:
        channel = caller.pool.get(peer.addrs[0])
        for _ in range(CALLS):
            caller.run(channel.info(timeout=30), timeout=60)

    # the target is up, and once a scrape after the calls has landed the counter reads CALLS
    promql = 'swarm_rpc_server_calls_total{job="swarm",method="/swarm.Peer/Info",outcome="ok"}'

    def counted() -> list[dict] | None:
        result = query(prometheus, promql)
        return result if result and float(result[0]["value"][1]) == CALLS else None

    result = wait_until(counted, 60, f"Prometheus did not report {CALLS} Info calls")
    assert len(result) == 1 and result[0]["metric"]["instance"].startswith("127.0.0.1:")
    assert query(prometheus, 'up{job="swarm"}')[0]["value"][1] == "1"
    # a histogram and a gauge of the same scrape, through PromQL
    peer_id = peer.addrs[0].rsplit("/", 1)[1]
    assert query(prometheus, f'swarm_peer_info{{peer_id="{peer_id}"}}')[0]["value"][1] == "1"
    count = query(prometheus, 'swarm_rpc_server_latency_seconds_count{method="/swarm.Peer/Info"}')
    assert float(count[0]["value"][1]) == CALLS


@needs_prometheus
@pytest.mark.timeout(120)
def test_promtool_accepts_a_live_exposition(daemon) -> None:
    peer, port = daemon
    with Peer(client_mode=True) as caller:
        caller.run(caller.pool.get(peer.addrs[0]).info(timeout=30), timeout=60)
    text = scrape(port)
    assert "swarm_rpc_server_calls_total" in text
    checked = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                             timeout=60, check=False)
    assert checked.returncode == 0, f"{checked.stdout}\n{checked.stderr}\n{text}"
    assert checked.stdout.strip() == "" and checked.stderr.strip() == "", checked.stdout + checked.stderr
