"""A private swarm's dashboard, served by a real HTTP server on loopback (docs/security.md, "The
dashboard of a private swarm"): refused without the token its operator got at start, served with
it (then by its cookie), served to anyone when the operator made it public; an open swarm's page
is public as before. The page-only client process joins a private swarm and prints the URL."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from procs import read_stdout_lines

from swarm.core.identity import Identity, IdentityFile
from swarm.core.loop import LoopThread
from swarm.core.membership import Authority
from swarm.dashboard.access import DashboardAccess
from swarm.dashboard.collector import DashboardConfig
from swarm.dashboard.server import DashboardServer
from swarm.dashboard.service import serve_dashboard
from swarm.dashboard.synthetic import SyntheticSwarm
from swarm.peer import Peer

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.timeout(90)

ROUTES = ("", "api/snapshot", "api/history", "api/events", "static/app.js")


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    """Status, the first bytes of the body, and the headers of a GET (an event stream is cut short)."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read(64 if "events" in url else -1), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def _private_peer(make_peer: Callable[..., Peer], authority: Authority | None = None) -> Peer:
    authority = authority or Authority.generate()
    identity = Identity.generate()
    return make_peer(identity=identity, swarm_authority=authority.public_text,
                     membership=authority.invite(identity.peer_id, ["trainer"], 3600))


def _serve(peer: Peer, public: bool = False) -> DashboardServer:
    return serve_dashboard(peer, DashboardConfig(refresh_period=0.5), public=public)


def test_a_private_swarms_page_is_refused_without_its_token_and_served_with_it(
        make_peer: Callable[..., Peer], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="swarm.dashboard"):
        server = _serve(_private_peer(make_peer))
    assert server.access.token and server.page_url == f"{server.url}?token={server.access.token}"
    # the log names the page, never its token (logs are kept and shared)
    assert any(server.url in r.getMessage() for r in caplog.records)
    assert not any(server.access.token in r.getMessage() for r in caplog.records)
    name = f"swarm_dashboard_{server.port}"  # a cookie per dashboard: browsers share one host's cookies across ports
    for route in ROUTES:  # no route, no file, no stream: nothing without the token
        status, body, _ = _get(server.url + route)
        assert status == 403 and b"private swarm" in body, (route, status)
        assert _get(f"{server.url}{route}?token=wrong")[0] == 403
        assert _get(server.url + route, {"Cookie": f"{name}=wrong"})[0] == 403
    status, body, headers = _get(server.page_url)  # the URL the operator got
    assert status == 200 and b"<title>swarm dashboard</title>" in body
    cookie = headers["set-cookie"]
    assert cookie.startswith(f"{name}={server.access.token};") and "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie
    for route in ROUTES[1:]:  # the page's own requests carry the cookie
        assert _get(server.url + route, {"Cookie": cookie.split(";")[0]})[0] == 200, route
    # beside another local application's cookie that `http.cookies` cannot parse
    assert _get(server.url + "api/snapshot", {"Cookie": f'x=a b; {cookie.split(";")[0]}'})[0] == 200
    assert _get(server.url + "api/snapshot", {"Authorization": f"Bearer {server.access.token}"})[0] == 200


def test_a_page_made_public_and_an_open_swarms_page_are_served_to_anyone(make_peer: Callable[..., Peer]) -> None:
    public = _serve(_private_peer(make_peer), public=True)
    open_swarm = _serve(make_peer())
    for server in (public, open_swarm):
        assert server.access.public and server.page_url == server.url
        for route in ROUTES:
            assert _get(server.url + route)[0] == 200, (server.url, route)


def test_the_page_only_client_joins_a_private_swarm_and_prints_the_url_with_its_token(
        make_peer: Callable[..., Peer], tmp_path: Path) -> None:
    authority = Authority.generate()
    peer = _private_peer(make_peer, authority)
    identity = tmp_path / "dashboard.id"
    watcher = IdentityFile(str(identity))
    watcher_id = watcher.load_or_create().peer_id
    watcher.release()
    certificate = tmp_path / "dashboard.cert"
    certificate.write_text(authority.invite(watcher_id, ["observer"], 3600).to_text())
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarm", "dashboard", "--initial-peers", peer.addrs[0], "--port", "0",
         "--identity", str(identity), "--swarm-authority", authority.public_text, "--membership", str(certificate)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        [url] = read_stdout_lines(proc, 1, 60, "dashboard", proc.kill, lambda: proc.stderr.read())
        base, _, token = url.partition("?token=")
        assert token and _get(base + "api/snapshot")[0] == 403
        status, body, _ = _get(f"{base}api/snapshot?token={token}")
        assert status == 200 and peer.peer_id.encode() in body  # it joined the private swarm and sees it
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.timeout(120)
def test_a_browser_opening_the_printed_url_gets_the_live_page_and_one_without_the_token_gets_nothing(
        tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "dashboard"))
    from browser import chrome

    loop = LoopThread("private-dashboard-test")
    server = DashboardServer(SyntheticSwarm(peers=3, experts=4, runs=1, trainers=2, servers=1),
                             DashboardConfig(refresh_period=0.3), DashboardAccess.for_swarm(private=True, public=False))
    loop.run(server.astart(), timeout=30)
    try:
        with chrome(tmp_path) as driver:
            driver.get(server.url)  # without the token: the refusal, and no page
            assert "private swarm" in driver.page_source and driver.execute_script("return !window.dashboardStats")
            driver.get(server.page_url)  # the page's own requests (files, stream) then ride on the cookie
            from selenium.webdriver.support.ui import WebDriverWait

            WebDriverWait(driver, 30, poll_frequency=0.1).until(lambda d: d.execute_script(
                "return window.dashboardStats && window.dashboardStats.snapshots >= 2"))
    finally:
        loop.run(server.ashutdown(), timeout=30)
        loop.loop.call_soon_threadsafe(loop.loop.stop)
