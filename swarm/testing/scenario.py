"""A lab scenario read from TOML: hosts and their links, the processes each host runs, and a
timeline of faults (network and process), written out or drawn at random by a chaos section.

    name = "wan-demo"
    duration = 120                      # seconds; the run also ends when every `until_exit` process exits
    [link]                              # every host's link unless it names its own
    up_mbit = 100
    delay_ms = 12.5
    [[hosts]]
    name = "experts"
    [[hosts]]
    name = "home"
    nat = true
    link = { up_mbit = 20, delay_ms = 30 }
    [[processes]]
    name = "server"
    host = "experts"
    command = ["{python}", "-m", "swarm", "--listen", "/ip4/{address}/tcp/0", "--identity", "{dir}/id.key"]
    ready = true                        # wait for its first line starting with "/" (its multiaddr)
    [[processes]]
    name = "late"
    host = "home"
    command = ["{python}", "-m", "swarm.demo.trainer", "--json", "--initial-peers", "{addr:server}"]
    start = 60                          # a late joiner
    until_exit = true
    [[faults]]
    at = 30
    kind = "stop"                       # kill | restart | kill_restart | stop | partition | profile | start
    target = "server"
    duration = 10
    [chaos]                             # one random fault every `every` s from `start` to `end`
    start = 20
    end = 300
    every = 20
    seed = 1
    menu = [{ kind = "kill_restart", targets = ["t1", "t2"], down = 5 }, { kind = "stop", targets = ["server"], duration = 10 }]

In commands, `{python}` is this Python, `{address}` the host's address, `{dir}` a directory that
belongs to the process and survives its restarts (identity, checkpoints), `{out}` the run's
output directory and `{addr:NAME}` the multiaddr process NAME printed when it was ready.
"""

from __future__ import annotations

import random
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from swarm.testing.lab import HostSpec, LinkProfile

FAULT_KINDS = ("kill", "restart", "kill_restart", "stop", "partition", "profile", "start", "heal")


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the message says where and why."""


@dataclass(frozen=True)
class ProcessSpec:
    """A process of the scenario. `start` None: started only by a `start` fault (a late joiner)."""

    name: str
    host: str
    command: tuple[str, ...]
    start: float | None = 0.0
    ready: bool = False
    until_exit: bool = False


@dataclass(frozen=True)
class Fault:
    """One event on the timeline.

    Attributes:
        at: seconds after the start.
        kind: kill (SIGKILL), restart (start again, same dir), kill_restart (kill, restart after
            `down` s), stop (SIGSTOP for `duration` s, then SIGCONT), partition (`target` against
            every other host, or `sides`, for `duration` s), heal, profile (a host's link
            becomes `link` for `duration` s, or for good), start (a process with no start time).
    """

    at: float
    kind: str
    target: str = ""
    duration: float | None = None
    down: float = 5.0
    sides: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    link: LinkProfile | None = None

    def describe(self) -> str:
        what = f"{self.kind} {self.target}".strip()
        if self.sides:
            what = f"partition {','.join(self.sides[0])} | {','.join(self.sides[1])}"
        return what + (f" for {self.duration:g} s" if self.duration else "")


@dataclass(frozen=True)
class Scenario:
    name: str
    duration: float
    hosts: tuple[HostSpec, ...]
    processes: tuple[ProcessSpec, ...]
    faults: tuple[Fault, ...] = field(default=())
    seed: int | None = None


def _link(data: dict[str, Any], where: str, base: LinkProfile | None = None) -> LinkProfile:
    known = {f.name for f in fields(LinkProfile)}
    unknown = set(data) - known
    if unknown:
        raise ScenarioError(f"{where}: unknown link keys {sorted(unknown)} (known: {sorted(known)})")
    values = {f.name: getattr(base, f.name) for f in fields(LinkProfile)} if base else {}
    values.update(data)
    try:
        return LinkProfile(**values)
    except (TypeError, ValueError) as e:
        raise ScenarioError(f"{where}: {e}") from None


def _require(table: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in table:
        raise ScenarioError(f"{where}: missing {key!r}")
    value = table[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind):
        raise ScenarioError(f"{where}: {key!r} must be a {kind.__name__}")
    return value


def _fault(data: dict[str, Any], where: str, base_link: LinkProfile) -> Fault:
    kind = _require(data, "kind", str, where)
    if kind not in FAULT_KINDS:
        raise ScenarioError(f"{where}: kind {kind!r} is not one of {', '.join(FAULT_KINDS)}")
    sides = data.get("sides")
    if sides is not None:
        if not (isinstance(sides, list) and len(sides) == 2 and all(isinstance(s, list) and s for s in sides)):
            raise ScenarioError(f"{where}: sides must be two non-empty lists of hosts")
        sides = (tuple(sides[0]), tuple(sides[1]))
    link = _link(data["link"], where, base_link) if "link" in data else None
    if kind == "profile" and link is None:
        raise ScenarioError(f"{where}: a profile fault needs a link")
    duration = data.get("duration")
    return Fault(at=float(_require(data, "at", float, where)), kind=kind, target=str(data.get("target", "")),
                 duration=None if duration is None else float(duration), down=float(data.get("down", 5.0)),
                 sides=sides, link=link)


def chaos_faults(chaos: dict[str, Any], where: str = "chaos") -> list[Fault]:
    """Draws one fault every `every` seconds from `menu` (seeded: the same file, the same faults)."""
    start, end = float(chaos.get("start", 0)), float(_require(chaos, "end", float, where))
    every = float(_require(chaos, "every", float, where))
    menu = chaos.get("menu")
    if every <= 0 or end < start:
        raise ScenarioError(f"{where}: needs every > 0 and end >= start")
    if not isinstance(menu, list) or not menu:
        raise ScenarioError(f"{where}: menu must list the faults to draw from")
    rng = random.Random(chaos.get("seed", 0))
    faults = []
    at = start
    for _ in range(10_000):
        if at > end:
            break
        choice = dict(rng.choice(menu))
        targets = choice.pop("targets", None)
        if targets:
            choice["target"] = rng.choice(targets)
        choice["at"] = at
        faults.append(choice)
        at += every
    return [_fault(f, f"{where} at {f['at']:g} s", LinkProfile()) for f in faults]


def parse(data: dict[str, Any]) -> Scenario:
    """Checks a scenario's tables and builds it; every error names the entry at fault."""
    name = str(data.get("name", "scenario"))
    duration = float(_require(data, "duration", float, "scenario"))
    if duration <= 0:
        raise ScenarioError("scenario: duration must be positive")
    base = _link(data.get("link", {}), "link")
    hosts = []
    for i, h in enumerate(data.get("hosts", [])):
        where = f"hosts[{i}]"
        try:
            hosts.append(HostSpec(_require(h, "name", str, where), _link(h.get("link", {}), where, base),
                                  bool(h.get("nat", False))))
        except ValueError as e:
            raise ScenarioError(f"{where}: {e}") from None
    host_names = {h.name for h in hosts}
    if not hosts:
        raise ScenarioError("scenario: no [[hosts]]")
    processes = []
    for i, p in enumerate(data.get("processes", [])):
        where = f"processes[{i}]"
        command = _require(p, "command", list, where)
        if not command or not all(isinstance(c, str) for c in command):
            raise ScenarioError(f"{where}: command must be a non-empty list of strings")
        host = _require(p, "host", str, where)
        if host not in host_names:
            raise ScenarioError(f"{where}: no host {host!r}")
        start = p.get("start", 0.0)
        processes.append(ProcessSpec(_require(p, "name", str, where), host, tuple(command),
                                     None if start == "manual" else float(start), bool(p.get("ready", False)),
                                     bool(p.get("until_exit", False))))
    proc_names = [p.name for p in processes]
    if len(set(proc_names)) != len(proc_names):
        raise ScenarioError("scenario: process names must be distinct")
    faults = [_fault(f, f"faults[{i}]", base) for i, f in enumerate(data.get("faults", []))]
    if "chaos" in data:
        faults += chaos_faults(data["chaos"])
    for f in faults:
        targets = set(f.sides[0] + f.sides[1]) if f.sides else {f.target} if f.target else set()
        network = f.kind in ("partition", "profile", "heal")
        known = host_names if network else set(proc_names)
        if f.kind != "heal" and (not targets or not targets <= known):
            raise ScenarioError(f"fault {f.describe()} at {f.at:g} s: targets must be {'hosts' if network else 'processes'}"
                                f" of this scenario")
    return Scenario(name, duration, tuple(hosts), tuple(processes), tuple(sorted(faults, key=lambda f: f.at)),
                    data.get("seed"))


def load(path: str | Path) -> Scenario:
    """Reads a scenario file (see the module docstring)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: not valid TOML: {e}") from None
    return parse(data)
