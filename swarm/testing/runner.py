"""Runs a scenario in a lab: starts each host's processes, applies the fault timeline, follows
what the processes print, shows it live, and collects the events for the report.

Processes that print the demo trainer's JSON events (`swarm.demo.trainer --json`) are followed
as trainers: their loss, collective steps (epochs), throughput and bytes go into the report.
Any other JSON line with a `kind` is kept as an event too (the benchmarks' workers use that).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from swarm.testing.lab import Lab
from swarm.testing.scenario import Fault, ProcessSpec, Scenario


@dataclass
class Managed:
    """A scenario process and its life: started, stopped, killed, restarted (same `dir`)."""

    spec: ProcessSpec
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    state: str = "pending"
    addr: str | None = None
    starts: int = 0
    last: dict[str, Any] = field(default_factory=dict)
    log: IO[bytes] | None = None


class Run:
    """One run of a scenario (use `run()`); `events` is everything that happened, in order."""

    def __init__(self, scenario: Scenario, out_dir: Path, live: bool = True, stream: IO[str] | None = None) -> None:
        self.scenario = scenario
        self.out_dir = out_dir
        self.live = live
        self.stream = stream or sys.stdout
        self.events: list[dict[str, Any]] = []
        self.lines: queue.Queue[tuple[str, int, bytes | None]] = queue.Queue()
        self.procs = {p.name: Managed(p, out_dir / "procs" / p.name) for p in scenario.processes}
        self.active: dict[int, tuple[Fault, float]] = {}  # fault id -> (fault, when it ends)
        self.undo: list[tuple[float, int, Fault]] = []  # (when, fault id, fault): the end of a fault
        self.started = 0.0
        self.lab: Lab | None = None
        self.relay: dict[str, Any] = {}
        self._next_view = 0.0

    # -- the clock and the record ---------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.started

    def record(self, kind: str, **data: Any) -> None:
        self.events.append({"t": round(self.now(), 3), "kind": kind, **data})

    def say(self, text: str) -> None:
        if self.live:
            self.stream.write(f"[{self.now():7.1f} s] {text}\n")
            self.stream.flush()

    # -- processes ----------------------------------------------------------------------------

    def _argv(self, m: Managed) -> list[str]:
        assert self.lab is not None
        values = {"python": sys.executable, "address": self.lab.address(m.spec.host), "dir": str(m.dir),
                  "out": str(self.out_dir)}
        argv = []
        for part in m.spec.command:
            for name, other in self.procs.items():
                if f"{{addr:{name}}}" in part:
                    if other.addr is None:
                        raise RuntimeError(f"{m.spec.name} needs the address of {name}, which never printed one")
                    part = part.replace(f"{{addr:{name}}}", other.addr)
            for key, value in values.items():
                part = part.replace(f"{{{key}}}", value)
            argv.append(part)
        return argv

    def start(self, m: Managed) -> None:
        assert self.lab is not None
        m.dir.mkdir(parents=True, exist_ok=True)
        if m.log is None:
            m.log = open(self.out_dir / "logs" / f"{m.spec.name}.log", "ab")  # noqa: SIM115 - closed in close()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        m.proc = self.lab.spawn(m.spec.host, self._argv(m), stdout=subprocess.PIPE, stderr=m.log, env=env)
        m.starts += 1
        m.state = "running"
        self.record("start", proc=m.spec.name, host=m.spec.host, pid=m.proc.pid, nth=m.starts)
        self.say(f"start {m.spec.name} on {m.spec.host}" + (" (again)" if m.starts > 1 else ""))
        generation = m.starts
        stdout = m.proc.stdout
        assert stdout is not None

        def follow() -> None:
            for line in iter(stdout.readline, b""):
                self.lines.put((m.spec.name, generation, line))
            self.lines.put((m.spec.name, generation, None))

        threading.Thread(target=follow, name=f"lab-read-{m.spec.name}", daemon=True).start()
        if m.spec.ready and m.addr is None:
            self._wait_ready(m, timeout=120.0)

    def _wait_ready(self, m: Managed, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while m.addr is None:
            left = deadline - time.monotonic()
            if left <= 0 or m.state != "running":
                raise RuntimeError(f"{m.spec.name} did not print its address within {timeout:.0f} s "
                                   f"(see {self.out_dir}/logs/{m.spec.name}.log)")
            self._drain(min(left, 0.5))

    def signal(self, m: Managed, signum: int) -> None:
        if m.proc is not None and m.proc.poll() is None:
            try:
                os.killpg(m.proc.pid, signum)
            except ProcessLookupError:
                pass

    # -- events from the processes ------------------------------------------------------------

    def _drain(self, timeout: float) -> None:
        try:
            name, generation, line = self.lines.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return
        while True:
            self._on_line(self.procs[name], generation, line)
            try:
                name, generation, line = self.lines.get_nowait()
            except queue.Empty:
                return

    def _on_line(self, m: Managed, generation: int, line: bytes | None) -> None:
        if line is None:
            if generation == m.starts and m.proc is not None:
                code = m.proc.wait()
                if m.state != "killed":
                    m.state = "exited"
                self.record("exit", proc=m.spec.name, code=code, killed=m.state == "killed")
                if m.state != "killed":
                    self.say(f"{m.spec.name} exited with status {code}")
            return
        text = line.decode(errors="replace").strip()
        if m.addr is None and text.startswith("/"):
            m.addr = text.split()[0]
            self.record("ready", proc=m.spec.name, addr=m.addr)
            return
        try:
            data = json.loads(text)
        except ValueError:
            return
        if not isinstance(data, dict) or "kind" not in data:
            return
        data.pop("name", None)
        kind = data.pop("kind")
        m.last[kind] = data
        self.record(kind, proc=m.spec.name, **data)
        if kind == "notice":
            self.say(f"{m.spec.name}: {data.get('message')}")

    # -- faults -------------------------------------------------------------------------------

    def apply(self, fid: int, fault: Fault) -> None:
        assert self.lab is not None
        self.record("fault", fault=fault.describe(), fault_kind=fault.kind, target=fault.target, id=fid)
        self.say(f"FAULT {fault.describe()}")
        m = self.procs.get(fault.target)
        end = None
        if fault.kind in ("kill", "kill_restart") and m is not None:
            m.state = "killed"
            self.signal(m, signal.SIGKILL)
            if fault.kind == "kill_restart":
                end = fault.down
        elif fault.kind == "restart" and m is not None:
            if m.proc is not None and m.proc.poll() is None:
                m.state = "killed"
                self.signal(m, signal.SIGKILL)
                m.proc.wait(10)
            self.start(m)
        elif fault.kind == "start" and m is not None:
            if m.state == "pending":
                self.start(m)
        elif fault.kind == "stop" and m is not None:
            self.signal(m, signal.SIGSTOP)
            m.state = "stopped"
            end = fault.duration
        elif fault.kind == "partition":
            sides = fault.sides or ((fault.target,), tuple(h for h in self.lab.hosts() if h != fault.target))
            self.lab.partition(sides[0], sides[1])
            end = fault.duration
        elif fault.kind == "heal":
            self.lab.heal()
        elif fault.kind == "profile" and fault.link is not None:
            self.lab.set_profile(fault.target, fault.link)
            end = fault.duration
        if end is not None:
            self.active[fid] = (fault, self.now() + end)
            self.undo.append((self.now() + end, fid, fault))
            self.undo.sort(key=lambda u: u[0])

    def end_fault(self, fid: int, fault: Fault) -> None:
        assert self.lab is not None
        self.active.pop(fid, None)
        m = self.procs.get(fault.target)
        if fault.kind == "kill_restart" and m is not None:
            self.start(m)
        elif fault.kind == "stop" and m is not None:
            self.signal(m, signal.SIGCONT)
            if m.state == "stopped":
                m.state = "running"
        elif fault.kind == "partition":
            self.lab.heal()
            for other, _ in list(self.active.values()):  # heal ends them all: redo the others
                if other.kind == "partition":
                    sides = other.sides or ((other.target,), tuple(h for h in self.lab.hosts() if h != other.target))
                    self.lab.partition(sides[0], sides[1])
        elif fault.kind == "profile":
            self.lab.set_profile(fault.target, self.lab.specs[fault.target].link)
        self.record("fault_end", fault=fault.describe(), fault_kind=fault.kind, target=fault.target, id=fid)
        self.say(f"end of {fault.describe()}")

    # -- the view -----------------------------------------------------------------------------

    def view(self, force: bool = False) -> None:
        if not self.live or (not force and time.monotonic() < self._next_view):
            return
        self._next_view = time.monotonic() + 5.0
        rows = [f"--- {self.scenario.name} at {self.now():.0f} / {self.scenario.duration:.0f} s; active faults: "
                + (", ".join(f.describe() for f, _ in self.active.values()) or "none")]
        for m in self.procs.values():
            p = m.last.get("progress")
            what = (f"epoch {p.get('epoch')} loss {p.get('loss', float('nan')):.3f} "
                    f"{p.get('samples_per_second', 0):.1f} samples/s {p.get('peers')} peers") if p else ""
            rows.append(f"    {m.spec.name:<12} {m.spec.host:<10} {m.state:<8} {what}")
        self.stream.write("\n".join(rows) + "\n")
        self.stream.flush()

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        """Builds the lab, runs the timeline to its end and returns the events (the lab is gone)."""
        for stale in ("logs", "procs"):  # a previous run's logs, identities and checkpoints
            shutil.rmtree(self.out_dir / stale, ignore_errors=True)
        (self.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        sc = self.scenario
        with Lab(list(sc.hosts), seed=sc.seed) as lab:
            self.lab = lab
            self.started = time.monotonic()
            self.record("lab", prefix=lab.prefix, hosts={h: lab.address(h) for h in lab.hosts()})
            # processes first, in the file's order (a later one may need an earlier one's address)
            timeline: list[tuple[float, int, Fault | str]] = [
                (p.start, i - len(sc.processes), p.name) for i, p in enumerate(sc.processes) if p.start is not None]
            timeline += [(f.at, i, f) for i, f in enumerate(sc.faults)]
            timeline.sort(key=lambda e: (e[0], e[1]))
            try:
                self._loop(timeline)
            finally:
                for m in self.procs.values():
                    if m.state == "stopped":
                        self.signal(m, signal.SIGCONT)
                self._stop_all()
                if lab.relay is not None:
                    self.relay = lab.relay_stats()
                self.record("end")
                self.view(force=True)
        for m in self.procs.values():
            if m.log is not None:
                m.log.close()
        return self.events

    def _loop(self, timeline: list[tuple[float, int, Fault | str]]) -> None:
        sc = self.scenario
        waiting_for = [m for m in self.procs.values() if m.spec.until_exit]
        while True:
            now = self.now()
            if now >= sc.duration:
                self.say("the scenario's time is up")
                return
            if waiting_for and all(m.state in ("exited",) for m in waiting_for):
                self.say("every process the scenario waits for has exited")
                return
            while timeline and timeline[0][0] <= now:
                _, fid, item = timeline.pop(0)
                if isinstance(item, str):
                    self.start(self.procs[item])
                else:
                    self.apply(fid, item)
            while self.undo and self.undo[0][0] <= self.now():
                _, fid, fault = self.undo.pop(0)
                self.end_fault(fid, fault)
            nxt = min([sc.duration, *(t for t, _, _ in timeline[:1]), *(u[0] for u in self.undo[:1])])
            self._drain(min(0.5, max(0.0, nxt - self.now())))
            self.view()

    def _stop_all(self, grace: float = 30.0) -> None:
        """SIGINT to every running process (trainers finish their step and leave), then SIGKILL
        after `grace` s: first the processes others did not wait for, then those they did (the
        servers), as an operator would stop a swarm, so no client outlives its server."""
        running = [m for m in self.procs.values() if m.proc is not None and m.proc.poll() is None]
        for group in ([m for m in running if not m.spec.ready], [m for m in running if m.spec.ready]):
            for m in group:
                self.signal(m, signal.SIGINT)
            deadline = time.monotonic() + grace
            for m in group:
                assert m.proc is not None
                try:
                    m.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.record("stop_timeout", proc=m.spec.name)
                    self.signal(m, signal.SIGKILL)
                    m.proc.wait(10)
        end = time.monotonic() + 5
        while time.monotonic() < end and not self.lines.empty():
            self._drain(0.1)
        self._drain(0.2)
