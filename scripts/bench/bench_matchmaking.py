#!/usr/bin/env python
"""Benchmark: matchmaking and deadlines with peers that start apart, come late, and die.

Starts N peer processes (real DHT, loopback), each `swarm.Averager(target_group_size=N)`. Every
peer begins its first round after a random delay up to `--spread` seconds, then runs `--rounds`
rounds, each after a random stretch of "computing" (`--compute`), averaging under the group key
of the round. In round `--kill-round` one member SIGKILLs itself mid-round (after sending its
first chunk, through its fault plan). Two settings run in the same invocation:

- adaptive: the defaults (leaders wait for announced and declared peers up to
  a learned bound, "group started" answers, round timeouts from measured rounds); each peer
  announces its next round with its expected readiness, as `swarm.Optimizer` does;
- fixed: `MatchmakingConfig(adaptive=False)`, the fixed-constant behaviour before it (0.3 s
  join window; the round's timeout is what the step has left), no announcements;
- follow (only with `--modes follow`): adaptive, with `MatchmakingConfig.follow_last_leader` and
  every step told to expect all N peers, as `swarm.Optimizer` runs it: a steady group's members
  go straight to their last leader, which starts without the DHT once it holds them all;
- noprobe (only with `--modes noprobe`): adaptive, but no member probes a peer whose stream
  broke (`refuses_connections` answers False where allreduce and averager call it), so a dead sender is waited for until its
  silence limit or the report time, and a dead reducer's report until the decide deadline, as
  before those probes existed.

`--log-dir DIR` writes each worker's debug log of `swarm.averaging` (the kill round's timeline:
reports, probes, the decision, fetches) to DIR/<N>-<index>-<k>.log (k: 0, or the setting the
victim's replacement started at).

The N processes start once per N, in parallel, and run the settings in the order given (the
default: adaptive, then fixed), each with its own Averager and prefix; the victim kills itself in
every setting's kill round and is started again before the next setting. Tensors are small by
default (16 Ki float32, 64 KiB): the figures are about matchmaking and deadlines, not bandwidth
(`--numel` for more).

Figures per (N, setting):
- left out: (peer, round) pairs where a live peer that was ready for the round (it called `step`
  before the round's main group formed) was not in that group (its step failed, or it ended in
  a smaller group), the kill round excepted; "missed late": the same for peers that came after;
- median interval: median time between consecutive round completions (last peer done);
- last ready to done: per round, from the last member's call to `step` to the last member done
  (what matchmaking and the all-reduce add once everyone is ready), median;
- kill gap: time without a completed round around the kill (last completion before it to the
  first complete round after it), and that gap over the median interval;
- figures the adaptive leaders logged (round timeout, wait bound).

    .venv/bin/python scripts/bench/bench_matchmaking.py [--peers 4 8 16] [--rounds 50] [--spread 2]

Hook for the network lab (branch `lab`, package `swarm.testing`): `--wrap` prefixes each worker's
command (e.g. ``--wrap "ip netns exec lab{index}"``) and `--listen` sets each peer's listen
multiaddr (``--listen "/ip4/10.77.0.{host}/tcp/0"``, host = index + 1), so the same benchmark runs
across namespaces with 50 or 200 ms RTT once the lab sets them up; without them it runs on loopback.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


# --------------------------------------------------------------------------------------------
# worker


def worker(cfg: dict[str, Any]) -> None:
    """One peer process; runs every setting of `cfg["modes"]` in turn, each with its own Averager
    (its own prefix), so N processes start once per N instead of once per setting."""
    import torch

    from swarm.averaging import allreduce as allreduce_module
    from swarm.averaging import averager as averager_module
    from swarm.peer import Peer

    torch.set_num_threads(1)
    if cfg.get("log"):
        import logging

        logging.basicConfig(filename=cfg["log"], level=logging.WARNING,
                            format="%(created).3f %(name)s %(message)s")
        logging.getLogger("swarm.averaging").setLevel(logging.DEBUG)
    probes = (allreduce_module.refuses_connections, averager_module.refuses_connections)
    peer = Peer(initial_peers=cfg["initial_peers"], listen=cfg["listen"])
    print(json.dumps({"event": "ready", "addr": peer.addrs[0]}), flush=True)
    for mode in cfg["modes"]:
        go = json.loads(sys.stdin.readline() or "{}")
        if go.get("mode") != mode:
            break
        if mode == "noprobe":
            async def never_gone(addr: str) -> bool:
                return False

            allreduce_module.refuses_connections = never_gone  # type: ignore[assignment]
            averager_module.refuses_connections = never_gone  # type: ignore[assignment]
        else:
            allreduce_module.refuses_connections, averager_module.refuses_connections = probes  # type: ignore[assignment]
        run_rounds(peer, mode, go["at"], go["until"], cfg)
    sys.stdin.readline()
    peer.shutdown()


def run_rounds(peer: Any, mode: str, at: float, until: float, cfg: dict[str, Any]) -> None:
    """One setting's rounds (stopping at `until`, the setting's wall budget)."""
    import torch

    from swarm.averaging import Action, Averager, AveragerConfig, FaultPlan, FaultPoint, MatchmakingConfig
    from swarm.core.errors import AveragingError

    rng = random.Random(cfg["seed"] * 7919 + cfg["index"])
    plan = FaultPlan()
    if cfg.get("kill_round") is not None:
        plan.add(FaultPoint.AFTER_CHUNKS_SENT, Action.KILL, after=1, rounds={cfg["kill_round"]})
    adaptive = mode != "fixed"
    follow = mode == "follow"
    config = AveragerConfig(matchmaking=MatchmakingConfig(adaptive=adaptive, follow_last_leader=follow))
    tensor = torch.zeros(cfg["numel"])
    avg = Averager(peer, [tensor], prefix=f"bench-{mode}", target_group_size=cfg["n"], min_group_size=2,
                   config=config, faults=plan)
    lo, hi = cfg["compute"]
    delay = rng.uniform(0, cfg["spread"])
    if adaptive:
        avg.announce(delay, group_key="r0")
    time.sleep(max(0.0, at + delay - time.time()))
    for r in range(cfg["rounds"]):
        if time.time() > until:
            break
        if r:
            compute = rng.uniform(lo, hi)
            if adaptive:
                try:
                    avg.announce(compute, group_key=f"r{r}")
                except Exception as e:  # noqa: BLE001 - an announcement is a hint
                    print(f"announcing round {r} failed: {e}", file=sys.stderr)
            time.sleep(compute)
        tensor.fill_(float(cfg["index"]))
        ready = time.time()
        try:
            result = avg.step(timeout=cfg["step_timeout"], group_key=f"r{r}", expected_size=cfg["n"] if follow else None)
            out = {"ok": True, "group": len(result.group), "round_id": result.round_id[:8]}
            if avg.matchmaking.timing.durations:  # when the group formed: the all-reduce's start
                out["formed"] = time.time() - avg.matchmaking.timing.durations[-1]
        except AveragingError as e:
            out = {"ok": False, "error": str(e)[:200]}
        out.update(event="round", mode=mode, round=r, ready=ready, end=time.time())
        if avg.matchmaking.last_start:
            out["leader"] = {k: v for k, v in avg.matchmaking.last_start.items() if k != "left_waiting_for"}
            avg.matchmaking.last_start = {}
        print(json.dumps(out), flush=True)
    print(json.dumps({"event": "done", "mode": mode}), flush=True)
    avg.shutdown()


# --------------------------------------------------------------------------------------------
# coordinator


class Proc:
    def __init__(self, cfg: dict[str, Any], wrap: str) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)]
        if wrap:
            cmd = shlex.split(wrap.format(index=cfg["index"], host=cfg["index"] + 1)) + cmd
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, env=env)
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.done: dict[str, threading.Event] = {m: threading.Event() for m in cfg["modes"]}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            self.events.append(event)
            if event["event"] == "ready":
                self.ready.set()
            elif event["event"] == "done":
                self.done[event["mode"]].set()
        self.ready.set()
        for done in self.done.values():
            done.set()

    def send(self, msg: dict[str, Any]) -> None:
        try:
            assert self.p.stdin is not None
            self.p.stdin.write(json.dumps(msg) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def stop(self) -> None:
        self.send({})
        self.send({})
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def run_n(n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Starts N workers once (in parallel) and runs every setting with them in turn; the victim,
    which SIGKILLs itself in each setting's kill round, is started again before the next one."""
    victim = n - 1
    base = {"n": n, "numel": args.numel, "rounds": args.rounds, "spread": args.spread,
            "compute": args.compute, "step_timeout": args.step_timeout, "seed": args.seed}

    def cfg(i: int, modes: list[str]) -> dict[str, Any]:
        log = os.path.join(args.log_dir, f"{n}-{i}-{len(args.modes) - len(modes)}.log") if args.log_dir else ""
        return {**base, "index": i, "modes": modes, "initial_peers": [first] if i else [],
                "listen": args.listen.format(index=i, host=i + 1), "log": log,
                "kill_round": args.kill_round if i == victim else None}

    started = time.monotonic()
    first = ""
    procs = [Proc(cfg(0, args.modes), args.wrap)]
    results: list[dict[str, Any]] = []
    try:
        procs[0].ready.wait(120)
        first = procs[0].events[0]["addr"]
        procs += [Proc(cfg(i, args.modes), args.wrap) for i in range(1, n)]
        for p in procs:
            if not p.ready.wait(180):
                raise RuntimeError("a worker did not start")
        startup = time.monotonic() - started
        for k, mode in enumerate(args.modes):
            if k:  # the victim killed itself in the last setting's kill round: a fresh one
                procs[victim].stop()
                procs[victim] = Proc(cfg(victim, args.modes[k:]), args.wrap)
                if not procs[victim].ready.wait(180):
                    raise RuntimeError("the victim's replacement did not start")
            began = time.monotonic()
            at = time.time() + 1.0
            for p in procs:
                p.send({"mode": mode, "at": at, "until": at + args.budget})
            budget = began + args.budget + args.step_timeout + 5.0
            for p in procs:
                p.done[mode].wait(max(0.0, budget - time.monotonic()))
            figures = summarize(n, mode, [[e for e in p.events if e.get("mode") == mode] for p in procs],
                                victim, args)
            figures["wall_s"] = round(time.monotonic() - began, 1)
            figures["startup_s"] = round(startup, 1)
            print(json.dumps(figures), flush=True)
            results.append(figures)
    finally:
        for p in procs:
            p.stop()
    return results


def summarize(n: int, mode: str, events_of: list[list[dict[str, Any]]], victim: int,
              args: argparse.Namespace) -> dict[str, Any]:
    by_round: dict[int, dict[int, dict[str, Any]]] = {}
    leaders: list[dict[str, Any]] = []
    for i, events in enumerate(events_of):
        for e in events:
            if e["event"] == "round":
                by_round.setdefault(e["round"], {})[i] = e
                if "leader" in e:
                    leaders.append(e["leader"])
    left_out = late = 0
    completed: list[tuple[int, float]] = []  # (round, when its last member finished)
    closing: list[float] = []  # from the last member's readiness to the last member done, per round
    for r in sorted(by_round):
        events = by_round[r]
        if r == args.kill_round:
            continue
        live = {i: e for i, e in events.items() if i != victim or r < args.kill_round}
        groups: dict[str, list[int]] = {}
        for i, e in live.items():
            if e["ok"]:
                groups.setdefault(e["round_id"], []).append(i)
        main = max(groups.values(), key=len) if groups else []
        # ready for the round: it called step before the round's main group formed
        main_end = max((live[i]["end"] for i in main), default=0.0)
        formed = min((live[i].get("formed", live[i]["end"]) for i in main), default=0.0)
        left_out += sum(1 for i, e in live.items() if i not in main and e["ready"] < formed)
        late += sum(1 for i, e in live.items() if i not in main and e["ready"] >= formed)
        if main:
            completed.append((r, main_end))
            closing.append(main_end - max(live[i]["ready"] for i in main))
    ends = [t for _, t in completed]
    intervals = [b - a for a, b in itertools.pairwise(ends)]
    median = statistics.median(intervals) if intervals else float("nan")
    before = [t for r, t in completed if r < args.kill_round]
    after = [t for r, t in completed if r > args.kill_round]
    gap = (after[0] - before[-1]) if before and after else float("nan")
    timeouts = [x["round_timeout"] for x in leaders if x.get("round_timeout") is not None]
    bounds = [x["wait_bound"] for x in leaders if x.get("wait_bound") is not None]
    return {
        "peers": n, "mode": mode, "rounds_done": len(completed), "left_out": left_out, "missed_late": late,
        "median_interval_s": round(median, 3), "kill_gap_s": round(gap, 3),
        "last_ready_to_done_s_median": round(statistics.median(closing), 4) if closing else None,
        "kill_gap_over_median": round(gap / median, 2) if math.isfinite(median) and median > 0 else None,
        "kill_extra_over_median": round((gap - median) / median, 2) if math.isfinite(median) and median > 0 else None,
        "round_timeout_s_median": round(statistics.median(timeouts), 3) if timeouts else None,
        "wait_bound_s_median": round(statistics.median(bounds), 3) if bounds else None,
        "group_size_mean": round(statistics.mean(
            e["group"] for ev in by_round.values() for e in ev.values() if e["ok"]), 2) if by_round else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--modes", nargs="+", default=["adaptive", "fixed"], choices=["adaptive", "fixed", "noprobe", "follow"])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--kill-round", type=int, default=25)
    parser.add_argument("--spread", type=float, default=2.0, help="start times spread up to this many seconds")
    parser.add_argument("--compute", type=float, nargs=2, default=[0.2, 0.5], help="seconds of work per round")
    parser.add_argument("--numel", type=int, default=1 << 14, help="float32 elements averaged")
    parser.add_argument("--step-timeout", type=float, default=30.0)
    parser.add_argument("--budget", type=float, default=300.0, help="wall seconds per (N, setting) at most")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-dir", default="", help="write each worker's swarm.averaging debug log here")
    parser.add_argument("--wrap", default="", help="prefix of each worker's command ({index}, {host})")
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help="listen multiaddr ({index}, {host})")
    args = parser.parse_args()
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    if args.worker:
        worker(json.loads(args.worker))
        return
    for n in args.peers:
        run_n(n, args)


if __name__ == "__main__":
    main()
