"""`swarm-peer dashboard` (a page-only client process) and the daemon's dashboard options, as an
operator meets them: a URL on stdout, the swarm on the page, exit 0 on SIGINT; clear errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import pytest
from procs import PeerProcess, read_stdout_lines

from swarm.cli.peer import main


def test_bad_dashboard_options_exit_2_with_the_reason(capsys):
    assert main(["dashboard"]) == 2
    assert "--initial-peers" in capsys.readouterr().err
    assert main(["--listen", "/ip4/127.0.0.1/tcp/0", "--dashboard-port", "70000"]) == 2
    assert "--dashboard-port must be a TCP port" in capsys.readouterr().err
    assert main(["dashboard", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--dashboard-experts", "not a prefix!"]) == 2
    assert "not expert grid prefixes" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_page_only_client_serves_the_swarm_on_loopback_and_stops_on_sigint():
    with PeerProcess("--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "WARNING") as daemon:
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarm", "dashboard", "--initial-peers", daemon.addrs[0], "--port", "0",
             "--dashboard-run", "some-run"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            [url] = read_stdout_lines(proc, 1, 60, "dashboard", proc.kill, lambda: proc.stderr.read())
            assert url.startswith("http://127.0.0.1:")  # loopback unless the operator names an address
            with urllib.request.urlopen(url + "api/snapshot", timeout=10) as r:
                view = json.loads(r.read())
            peers = {p["id"]: p for p in view["peers"]}
            daemon_id = daemon.addrs[0].rsplit("/", 1)[1]
            assert peers[daemon_id]["reachability"] != "unreachable" and peers[daemon_id]["rtt_ms"] > 0
            assert [p["reachability"] for p in view["peers"] if p["self"]] == ["client"]
            assert [r["run_id"] for r in view["runs"]] == ["some-run"]
            with urllib.request.urlopen(url, timeout=10) as r:
                assert b"<title>swarm dashboard</title>" in r.read()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
