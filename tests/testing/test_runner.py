"""The scenario runner for real (needs root): processes on lab hosts, the fault timeline applied
to them with real signals, a restart that finds its own directory again, and the report."""

import itertools
import json
import textwrap
from pathlib import Path

import pytest

from swarm.testing import report
from swarm.testing.netns import lab_namespaces
from swarm.testing.runner import Run
from swarm.testing.scenario import parse

pytestmark = pytest.mark.usefixtures("needs_lab")

# a stand-in for a peer: prints an address, counts its starts in its own dir, reports progress
FAKE = textwrap.dedent("""
    import json, pathlib, signal, sys, time
    state = pathlib.Path(sys.argv[1]) / "starts"
    starts = int(state.read_text()) + 1 if state.exists() else 1
    state.write_text(str(starts))
    stop = []
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))
    print("/ip4/" + sys.argv[2] + "/tcp/1", flush=True)
    print(json.dumps({"kind": "notice", "name": "x", "message": f"start number {starts}"}), flush=True)
    for i in range(200):
        if stop:
            break
        print(json.dumps({"kind": "progress", "epoch": i, "loss": 5 - i / 100, "samples_per_second": 10.0,
                          "samples": i}), flush=True)
        time.sleep(0.1)
""")


def scenario(tmp_path: Path) -> dict:
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    cmd = ["{python}", str(script), "{dir}", "{address}"]
    return {
        "name": "short", "duration": 8, "seed": 1, "link": {"delay_ms": 2},
        "hosts": [{"name": "a"}, {"name": "b"}, {"name": "home", "nat": True}],
        "processes": [{"name": "p", "host": "a", "command": cmd, "ready": True},
                      {"name": "q", "host": "home", "command": [*cmd, "{addr:p}"]},
                      {"name": "late", "host": "b", "command": cmd, "start": "manual"}],
        "faults": [{"at": 1, "kind": "stop", "target": "q", "duration": 1},
                   {"at": 1.5, "kind": "start", "target": "late"},
                   {"at": 2.5, "kind": "kill_restart", "target": "p", "down": 0.5},
                   {"at": 4, "kind": "partition", "target": "a", "duration": 1}],
    }


def test_a_scenario_runs_its_faults_and_reports_them(tmp_path: Path) -> None:
    run = Run(parse(scenario(tmp_path)), tmp_path / "out", live=False)
    events = run.run()
    assert lab_namespaces(events[0]["prefix"]) == []
    kinds = [(e["kind"], e.get("fault_kind")) for e in events]
    for fault in ("stop", "kill_restart", "partition"):
        assert ("fault", fault) in kinds and ("fault_end", fault) in kinds
    starts = [e for e in events if e["kind"] == "start"]
    assert [e["proc"] for e in starts].count("p") == 2
    assert any(e["proc"] == "late" for e in starts)
    notices = [e["message"] for e in events if e["kind"] == "notice" and e["proc"] == "p"]
    assert notices == ["start number 1", "start number 2"]  # the restart found its own dir
    exits = {e["proc"]: e for e in events if e["kind"] == "exit"}
    assert exits["q"]["code"] == 0  # stopped and continued, then stopped cleanly at the end
    q_progress = [e["t"] for e in events if e["kind"] == "progress" and e["proc"] == "q"]
    stopped_at = next(e["t"] for e in events if e["kind"] == "fault" and e["fault_kind"] == "stop")
    gaps = [b - a for a, b in itertools.pairwise(q_progress) if a >= stopped_at - 0.5]
    assert max(gaps) >= 0.8  # SIGSTOP froze it
    json_path, png = report.write(events, tmp_path / "out", "short", run.relay)
    figures = json.loads(json_path.read_text())["figures"]
    assert figures["crashes"] == []
    assert len(figures["faults"]) == 4
    assert figures["relay"]["queues"]
    if png is not None:
        assert png.stat().st_size > 10_000
