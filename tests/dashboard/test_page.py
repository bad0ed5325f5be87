"""The page in a real headless chromium, fed by a synthetic swarm: whatever a peer reports is shown
as text and never runs; the page follows live updates without reloads."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from browser import chrome

from swarm.core.loop import LoopThread
from swarm.dashboard.collector import DashboardConfig
from swarm.dashboard.server import DashboardServer
from swarm.dashboard.synthetic import SyntheticSwarm

EVIL = '<img src=x onerror="window.__pwned=1">'


@pytest.fixture
def serve() -> Iterator:
    loop = LoopThread("dashboard-test")
    servers: list[DashboardServer] = []

    def start(source: SyntheticSwarm, **config: object) -> DashboardServer:
        server = DashboardServer(source, DashboardConfig(**{"refresh_period": 0.3, **config}))
        loop.run(server.astart(), timeout=30)
        servers.append(server)
        return server

    yield start
    for server in servers:
        loop.run(server.ashutdown(), timeout=30)
    loop.loop.call_soon_threadsafe(loop.loop.stop)


def _wait(driver, script: str, timeout: float = 20.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: d.execute_script(script))


@pytest.mark.timeout(90)
def test_strings_a_hostile_peer_reports_are_shown_as_text_and_nothing_they_hold_executes(serve, tmp_path):
    server = serve(SyntheticSwarm(peers=6, experts=12, runs=1, trainers=3, servers=2, text=EVIL))
    with chrome(tmp_path) as driver:
        driver.get(server.url)
        _wait(driver, "return window.dashboardStats && window.dashboardStats.snapshots >= 3 "
                      "&& window.dashboardStats.experts > 0")
        shown = driver.execute_script("""
            return {run: document.querySelector('.run-id').textContent,
                    uid: document.querySelector('#experts .cell').dataset.uid,
                    role: document.querySelector('#peers tbody tr td:nth-child(4)').title,
                    version: document.querySelector('#peers tbody tr td:nth-child(3)').textContent,
                    images: document.querySelectorAll('img').length,
                    pwned: window.__pwned === undefined ? null : window.__pwned};""")
        driver.save_screenshot(str(tmp_path / "hostile.png"))
    assert shown["run"] == EVIL + "0" and shown["uid"].startswith(EVIL) and shown["role"] == EVIL
    assert shown["version"] == EVIL
    assert shown["images"] == 0 and shown["pwned"] is None  # no element was parsed out of the text


@pytest.mark.timeout(60)
def test_the_server_is_read_only_caps_live_pages_and_sends_a_strict_content_policy(serve):
    server = serve(SyntheticSwarm(peers=3, experts=4, runs=1, trainers=2, servers=1), max_clients=1)
    with urllib.request.urlopen(server.url + "api/snapshot", timeout=10) as r:
        snapshot = json.loads(r.read())
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    assert len(snapshot["peers"]) == 3 and snapshot["experts"]["total"] == 4
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(server.url + "api/snapshot", data=b"{}", method="POST"),
                               timeout=10)
    assert e.value.code == 405
    with urllib.request.urlopen(server.url + "api/events", timeout=10) as first:
        assert first.readline() == b"event: history\n"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.url + "api/events", timeout=10)
        assert e.value.code == 503  # one page at a time here: the second is refused, the first keeps going
        assert first.readline().startswith(b"data: ")
