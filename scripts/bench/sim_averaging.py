#!/usr/bin/env python
"""Averaging simulation: hundreds of peers averaging in Moshpit groups, over swarm's own code.

Every peer is a real `swarm.dht.DHT` node with a real `swarm.averaging.Averager` (matchmaking
through DHT declarations, the butterfly all-reduce with its partitioning, agreement and fetches,
Moshpit grid keys from `moshpit_group_key` / `moshpit_next_coords`); only the links and the clock
are simulated (`simnet.py`: virtual time; access round trips log-normal within 10-300 ms; unary
messages lost with probability `--loss`, stream messages delivered in order).

Peers sit on a Moshpit grid of groups of `--group` (256 peers: 16 x 16; 1,024: 16 x 16 x 4), each
at its own cell, and run `--rounds` steps; in round t a peer looks for the group
`moshpit_group_key(t, coords)` and then takes its index in the group as its coordinate along the
averaged dimension. In round `--die-round`, `--die` of the peers crash silently at random moments
in the round's first seconds (while groups form and parts are in flight). The table shows, per
round: the groups that formed and their sizes, the steps that failed, the largest and median
relative error of a surviving peer's vector against the mean of the survivors' vectors
(||x_i - m|| / ||m||), the shift of that mean against the all-peer starting mean (what the
dying peers took with them), and the averaging and matchmaking payload bytes per peer.

With `--die-when between` the peers crash after the round before `--die-round` and before its
matchmaking; `--regroup` then lets the survivors regroup by roll call (`moshpit.RowRoll`): the
k-th survivor of every last-round group meets the k-th of the others with weight = its group's
survivors (a group that holds one of every group outputs the survivors' exact mean), and in the
round after, every last-round group meets again with weight 1 for complete-group peers, 0 else.

With `--all-to-all`, the same peers then average once more from fresh vectors in one group of
all of them (one butterfly all-reduce over N members), for comparison.

Usage: .venv/bin/python scripts/bench/sim_averaging.py [--peers 256] [--group 16] [--rounds R]
       [--die 0.1] [--die-round 1] [--die-when inside|between] [--regroup] [--numel 4096]
       [--all-to-all] [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import simnet

simnet.install_virtual_time()  # before swarm is imported: some of it binds time.time as a default
simnet.share_parsing()

PEER: contextvars.ContextVar[str] = contextvars.ContextVar("sim_peer", default="-")  # `--trace`: whose step logs

AVERAGING = ("/swarm.Averaging/Reduce", "/swarm.Averaging/Report", "/swarm.Averaging/Fetch")
MATCHMAKING = ("/swarm.Averaging/Join",)


TRACE = logging.getLogger("sim")


def _stamp(record: logging.LogRecord) -> bool:
    record.vtime = simnet.CLOCK.now
    record.peer = PEER.get()
    return True


def grid_for(n: int, group: int) -> list[int]:
    """The Moshpit grid for `n` peers in groups of `group`: as many full dimensions as fit, then the rest."""
    dims = max(1, math.ceil(math.log(n, group) - 1e-9))
    grid = [group] * (dims - 1)
    grid.append(math.ceil(n / group ** (dims - 1)))
    return grid


def cell_of(index: int, grid: list[int]) -> list[int]:
    coords = []
    for size in grid:
        coords.append(index % size)
        index //= size
    return coords


class AveragingSimulation:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from swarm.dht import DHTConfig

        self.args = args
        self.rng = random.Random(args.seed)
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        self.net = simnet.SimNetwork(random.Random(args.seed + 1), loss=args.loss, retransmit=True)
        self.dht_config = DHTConfig(request_timeout=3.0, lookup_timeout=10.0)
        self.peers: list[simnet.SimPeer] = []
        self.live: set[str] = set()
        self.tensors: dict[str, Any] = {}
        self.averagers: dict[str, Any] = {}
        self.grid = grid_for(args.peers, args.group)
        self.coords: dict[str, list[int]] = {}
        self.row_sizes: dict[str, float] = {}

    async def build(self) -> None:
        from swarm.core.identity import Identity

        while len(self.peers) < self.args.peers:
            wave = []
            for _ in range(min(25 if self.peers else 1, self.args.peers - len(self.peers))):
                peer = simnet.SimPeer(self.net, Identity.from_seed(self.rng.randbytes(32)))
                initial = [p.addrs[0] for p in self.rng.sample(self.peers, min(3, len(self.peers)))]
                wave.append((peer, initial))
            await asyncio.gather(*(peer.start_dht(self.dht_config, initial) for peer, initial in wave))
            self.peers.extend(peer for peer, _ in wave)
        self.live = {p.peer_id for p in self.peers}
        await asyncio.sleep(30)

    def make_averagers(self, prefix: str, group_size: int) -> None:
        import torch

        from swarm.averaging import AllReduceConfig, Averager, AveragerConfig, MatchmakingConfig

        config = AveragerConfig(
            allreduce=AllReduceConfig(chunk_bytes=max(4096, self.args.numel * 4)),
            matchmaking=MatchmakingConfig(target_group_size=group_size, min_group_size=2,
                                          join_window=self.args.join_window,
                                          leader_misses=10**9 if self.args.no_leader_checks else 3),
        )
        for old in self.averagers.values():
            old.matchmaking.close()
        self.averagers = {}
        self.tensors = {}
        for peer in self.peers:
            if peer.peer_id not in self.live:
                continue
            tensor = torch.rand(self.args.numel) * 2  # values in [0, 2): the mean is near 1
            self.tensors[peer.peer_id] = tensor
            self.averagers[peer.peer_id] = Averager(
                peer, [tensor], prefix=prefix, target_group_size=group_size, min_group_size=2, config=config,
            )

    def errors(self) -> tuple[float, float, Any]:
        import torch

        stacked = torch.stack([self.tensors[p].double() for p in sorted(self.live)])
        mean = stacked.mean(0)
        errors = ((stacked - mean).norm(dim=1) / mean.norm()).tolist()
        return max(errors), statistics.median(errors), mean

    async def kill(self, peer_id: str, at: float, steps: dict[str, asyncio.Task[Any]]) -> None:
        await asyncio.sleep(at)
        self.live.discard(peer_id)
        step = steps.get(peer_id)
        if step is not None:
            step.cancel()
        peer = next(p for p in self.peers if p.peer_id == peer_id)
        await peer.crash()

    async def round(self, r: int, key_of: Any, deaths: int, weight_of: Any = None,
                    size_of: Any = None) -> dict[str, Any]:
        from swarm.averaging import moshpit_group_key  # noqa: F401  (documents where keys come from)
        from swarm.averaging.moshpit import astep_retrying

        args = self.args
        before = Counter(self.net.traffic.by_method)
        start = simnet.CLOCK.now
        steps: dict[str, asyncio.Task[Any]] = {}
        if deaths and args.die_when == "between":  # after the last round, before this one's matchmaking
            for victim in self.rng.sample(sorted(self.live), deaths):
                await self.kill(victim, 0.0, {})
            deaths = 0
        token = simnet.TAG.set("averaging")
        try:
            for peer_id in sorted(self.live):
                PEER.set(peer_id[-8:])  # the step's tasks inherit it (`--trace` labels their lines)
                weight = 1.0 if weight_of is None else weight_of(peer_id)
                step = astep_retrying if args.retry else type(self.averagers[peer_id]).astep
                steps[peer_id] = asyncio.ensure_future(step(
                    self.averagers[peer_id], timeout=args.step_timeout, weight=weight, group_key=key_of(peer_id),
                    expected_size=None if size_of is None else size_of(peer_id)))
        finally:
            simnet.TAG.reset(token)
            PEER.set("-")
        killers = []
        if deaths:
            victims = self.rng.sample(sorted(self.live), deaths)
            killers = [asyncio.ensure_future(self.kill(v, args.die_from + self.rng.uniform(0.0, args.die_within), steps))
                       for v in victims]
        await asyncio.gather(*steps.values(), *killers, return_exceptions=True)
        took = simnet.CLOCK.now - start
        groups: dict[str, tuple[str, ...]] = {}
        failed: Counter[str] = Counter()
        results = {}
        for peer_id, step in steps.items():
            if peer_id not in self.live:
                continue
            if step.cancelled() or step.exception() is not None:
                reason = "cancelled" if step.cancelled() else str(step.exception())
                failed[reason[:300]] += 1
                continue
            result = step.result()
            results[peer_id] = result
            groups[result.round_id] = result.group
        if args.trace:
            # every leader's account of why it started when it did, for tracing a split
            for round_id, group in groups.items():
                start_info = self.averagers[group[0]].matchmaking.last_start if group[0] in self.averagers else None
                TRACE.info("round %d: %s led %s (%d members): %s", r, group[0][-8:], round_id[:8], len(group),
                           start_info)
            for peer_id, step in steps.items():
                if peer_id in self.live and not step.cancelled() and step.exception() is not None:
                    TRACE.info("round %d: %s failed: %s", r, peer_id[-8:], step.exception())
        sizes = [len(g) for g in groups.values()]
        traffic = Counter(self.net.traffic.by_method)
        traffic.subtract(before)
        n = len(self.live)
        return {
            "round": r,
            "live": n,
            "groups": len(groups),
            "size_min": min(sizes, default=0),
            "size_mean": statistics.mean(sizes) if sizes else 0.0,
            "size_max": max(sizes, default=0),
            "failed": sum(failed.values()),
            "failures": dict(failed),
            "virtual_s": took,
            "averaging_kib_per_peer": sum(traffic[m] for m in AVERAGING) / 1024 / max(1, n),
            "matchmaking_kib_per_peer": (sum(traffic[m] for m in MATCHMAKING)
                                         + sum(v for m, v in traffic.items() if m.startswith("/swarm.DHT/")))
                                        / 1024 / max(1, n),
            "results": results,
        }

    async def moshpit(self) -> list[dict[str, Any]]:
        from swarm.averaging import moshpit_group_key
        from swarm.averaging.moshpit import moshpit_next_coords, row_key, row_weight

        args = self.args
        self.make_averagers("moshpit", args.group)
        for i, peer in enumerate(self.peers):
            self.coords[peer.peer_id] = cell_of(i, self.grid)
        _, _, start_mean = self.errors()
        err_max, err_median, _ = self.errors()
        rows = [{"round": "start", "live": len(self.live), "err_max": err_max, "err_median": err_median,
                 "mean_shift": 0.0}]
        last: dict[str, Any] = {}  # peer -> its result of the last round
        before_last: dict[str, Any] = {}  # peer -> its result of the round before
        rows_of_regroup: dict[str, Any] = {}  # peer -> its result of the round before the regrouping
        weights: dict[str, float] = {}
        sizes: dict[str, int | None] = {}
        for r in range(args.rounds):
            deaths = round(args.die * args.peers) if r == args.die_round else 0
            key_of: Any = lambda p, r=r: moshpit_group_key(r, self.coords[p])
            regrouped = args.regroup and args.die_when == "between" and r in (args.die_round, args.die_round + 1)
            if regrouped and r == args.die_round:
                # the deaths come first (between the rounds); then every survivor reads its row's roll call
                row_deaths, deaths = deaths, 0
                for victim in self.rng.sample(sorted(self.live), row_deaths):
                    await self.kill(victim, 0.0, {})
                keys, weights, rows_of_regroup = await self.regroup(r, last)
                self.row_sizes = dict(weights)  # each row's survivors: how many meet again the round after
                key_of = keys.__getitem__
            elif args.regroup and args.die_when == "inside" and r == args.die_round + 1 and r >= 2:
                # the deaths fell inside the last round, whose groups (the k-th member of every group of
                # the round before: a full grid's columns) formed with or without them; every group of
                # the round before meets again, peers whose last group held one of every group (it
                # output the same mean in every such group) weight 1, the rest 1e-6 per group missing
                # (`row_weight`: where a whole group died, the groups that held all the others lead)
                groups_before = max(1, args.peers // self.grid[(r - 2) % len(self.grid)])
                keys = {p: row_key(r, before_last[p].round_id) for p in self.live if p in before_last}
                weights = {p: row_weight(len(last[p].contributors), groups_before) if p in last else row_weight(1, groups_before)
                           for p in self.live}
                key_of = lambda p, keys=keys, r=r: keys.get(p, f"r{r}.orphan")
                regrouped = True
            elif regrouped:
                groups_before = max(1, args.peers // self.grid[(r - 2) % len(self.grid)])  # groups in the round before the deaths
                keys = {p: row_key(r, rows_of_regroup[p].round_id) for p in self.live if p in rows_of_regroup}
                weights = {p: 1.0 if p in last and len(last[p].contributors) >= groups_before else 0.0 for p in self.live}
                key_of = lambda p, keys=keys, r=r: keys.get(p, f"r{r}.orphan")
                sizes = {p: int(self.row_sizes.get(p, 0)) or None for p in self.live}
            row = await self.round(r, key_of, deaths, weights.get if regrouped else None,
                                   sizes.get if regrouped and r > args.die_round else None)
            results = row.pop("results")
            before_last, last = last, results
            for peer_id, result in results.items():
                if regrouped:
                    continue  # the regrouping rounds leave the grid coordinates as they were
                self.coords[peer_id] = moshpit_next_coords(r, self.coords[peer_id], result.group.index(peer_id),
                                                           self.grid)
            row["err_max"], row["err_median"], mean = self.errors()
            row["mean_shift"] = float((mean - start_mean).norm() / start_mean.norm())
            rows.append(row)
        return rows

    async def regroup(self, r: int, last: dict[str, Any]) -> tuple[dict[str, str], dict[str, float], dict[str, Any]]:
        """Every survivor's roll call of its last group (`RowRoll`, through the DHT): its key and weight."""
        from swarm.averaging.moshpit import RowRoll, regroup_key, survivor_rank

        peers = {p.peer_id: p for p in self.peers}
        live = [p for p in sorted(self.live) if p in last]
        expiration = time.time() + 120

        async def call(peer_id: str) -> tuple[int, int]:
            result = last[peer_id]
            roll = RowRoll(peers[peer_id].dht, "moshpit", result.round_id, result.group)
            return survivor_rank(peer_id, await roll.call(peer_id, self.args.roll_settle, expiration))

        token = simnet.TAG.set("averaging")
        try:
            ranks = await asyncio.gather(*(call(p) for p in live))
        finally:
            simnet.TAG.reset(token)
        keys = {p: regroup_key(r, rank) for p, (rank, _) in zip(live, ranks)}
        weights = {p: float(n) for p, (_, n) in zip(live, ranks)}
        for p in self.live:
            keys.setdefault(p, f"r{r}.orphan")
            weights.setdefault(p, 1.0)
        return keys, weights, {p: last[p] for p in live}

    async def all_to_all(self) -> dict[str, Any]:
        self.make_averagers("all", len(self.live))
        err_before, _, _ = self.errors()
        row = await self.round(0, lambda p: "all", 0)
        row.pop("results")
        row["err_max"], row["err_median"], _ = self.errors()
        row["err_before"] = err_before
        return row

    async def run(self) -> dict[str, Any]:
        wall0 = time.perf_counter()
        await self.build()
        rows = await self.moshpit()
        out: dict[str, Any] = {"peers": self.args.peers, "grid": self.grid, "moshpit": rows}
        if self.args.all_to_all:
            out["all_to_all"] = await self.all_to_all()
        out["wall_s"] = time.perf_counter() - wall0
        for peer in self.peers:
            if peer.peer_id in self.live:
                await peer.crash()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=256)
    parser.add_argument("--group", type=int, default=16, help="Moshpit group size (the grid's side)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds to run (0: ceil(log_group N) + 2)")
    parser.add_argument("--die", type=float, default=0.1, help="fraction of the peers that crash")
    parser.add_argument("--die-round", type=int, default=1, help="the round in which they crash")
    parser.add_argument("--die-within", type=float, default=2.0, help="they crash within this many seconds of its start")
    parser.add_argument("--die-from", type=float, default=0.0,
                        help="they crash from this many seconds into the round on (within --die-within after)")
    parser.add_argument("--retry", action="store_true",
                        help="the survivors of a group whose all-reduce failed average again within the step's "
                             "time (moshpit.astep_retrying)")
    parser.add_argument("--die-when", choices=("inside", "between"), default="inside",
                        help="inside: the crashes happen during the round; between: after the round before, "
                             "before this round's matchmaking")
    parser.add_argument("--regroup", action="store_true",
                        help="with --die-when between: the survivors regroup by roll call (moshpit.RowRoll), "
                             "the k-th survivor of every group with the k-th of every other, weighted by its "
                             "group's survivors; the round after, each group meets again. With --die-when "
                             "inside: in the round after the deaths, each group of the round before meets "
                             "again, peers whose last group held one of every group weight 1, the rest 1e-6 per "
                             "group missing (moshpit.row_weight)")
    parser.add_argument("--roll-settle", type=float, default=6.0,
                        help="seconds a survivor waits for the others' roll-call records before reading them")
    parser.add_argument("--numel", type=int, default=4096, help="floats averaged per peer")
    parser.add_argument("--loss", type=float, default=0.01,
                        help="probability that a unary message is lost (TCP resends it after a timeout)")
    parser.add_argument("--step-timeout", type=float, default=30.0)
    parser.add_argument("--join-window", type=float, default=2.0,
                        help="MatchmakingConfig.join_window: a leader with enough members waits this long for one more")
    parser.add_argument("--all-to-all", action="store_true", help="also average once in one group of all peers")
    parser.add_argument("--full-refresh", action="store_true",
                        help="DHT bucket refreshes as full lookups (as refreshes were before they became cheap)")
    parser.add_argument("--no-leader-checks", action="store_true",
                        help="followers never give up a silent leader (the behaviour before the fix)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", help="write matchmaking's debug log here (virtual time, the stepping peer) and "
                                        "each leader's reason to start")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    target_rounds = math.ceil(math.log(args.peers, args.group) - 1e-9) + 1
    if not args.rounds:
        args.rounds = target_rounds + 1

    logging.basicConfig(level=logging.WARNING)
    if args.trace:
        handler = logging.FileHandler(args.trace, mode="w")
        handler.addFilter(_stamp)
        handler.setFormatter(logging.Formatter("%(vtime)9.3f %(peer)s %(name)s: %(message)s"))
        for name in ("swarm.averaging.matchmaking", "swarm.averaging.election", "swarm.averaging.moshpit", TRACE.name):
            logging.getLogger(name).setLevel(logging.DEBUG)
            logging.getLogger(name).addHandler(handler)
            logging.getLogger(name).propagate = False
    if args.full_refresh:
        from swarm.dht.node import DHTNode

        DHTNode._refresh_lookup = DHTNode.find_nearest_nodes
    out = simnet.run(AveragingSimulation(args).run())
    vector_kib = args.numel * 4 / 1024
    print(f"{args.peers} peers on a {' x '.join(map(str, out['grid']))} Moshpit grid, groups of {args.group}; "
          f"{args.numel} float32 per peer ({vector_kib:.0f} KiB); {args.die:.0%} crash {'in' if args.die_when == 'inside' else 'before'} round {args.die_round + 1}"
          f"{', survivors regroup by roll call' if args.regroup else ''}; "
          f"access RTT 10-300 ms (median 60), unary loss {args.loss:.0%} (resent after an RTO); join_window {args.join_window:g} s; goal: max error < 1e-5 after "
          f"ceil(log{args.group} N) + 1 = {target_rounds} rounds")
    print(f"{'round':>5} {'live':>5} {'groups':>6} {'size min/mean/max':>17} {'failed':>6} {'max err':>9} "
          f"{'median err':>10} {'mean shift':>10} {'avg KiB/peer':>12} {'match KiB/peer':>14} {'virtual s':>9}")
    for row in out["moshpit"]:
        if row["round"] == "start":
            print(f"{'start':>5} {row['live']:5d} {'':>6} {'':>17} {'':>6} {row['err_max']:9.2e} "
                  f"{row['err_median']:10.2e}")
            continue
        sizes = f"{row['size_min']}/{row['size_mean']:.1f}/{row['size_max']}"
        print(f"{row['round'] + 1:5d} {row['live']:5d} {row['groups']:6d} {sizes:>17} {row['failed']:6d} "
              f"{row['err_max']:9.2e} {row['err_median']:10.2e} {row['mean_shift']:10.2e} "
              f"{row['averaging_kib_per_peer']:12.1f} {row['matchmaking_kib_per_peer']:14.1f} {row['virtual_s']:9.1f}")
        if row["failures"]:
            print(f"      failures: {row['failures']}")
    rows = [r for r in out["moshpit"] if r["round"] != "start"]
    moshpit_kib = sum(r["averaging_kib_per_peer"] for r in rows[:target_rounds])
    print(f"Moshpit, {target_rounds} rounds: {moshpit_kib:.1f} KiB of averaging traffic per peer "
          f"({moshpit_kib / vector_kib:.2f} x its vector), {args.group - 1} streams per peer per round")
    n = args.peers
    print(f"all-to-all, by formula: one butterfly round over {n} peers sends and receives "
          f"2 x (N-1)/N = {2 * (n - 1) / n:.2f} x the vector per peer over {n - 1} streams; naive all-to-all "
          f"(everyone sends everyone its vector) {2 * (n - 1)} x")
    if "all_to_all" in out:
        row = out["all_to_all"]
        print(f"all-to-all, measured (one group of all {row['live']}): groups {row['groups']}, sizes "
              f"{row['size_min']}-{row['size_max']}, failed {row['failed']}, max err {row['err_before']:.2e} -> "
              f"{row['err_max']:.2e}, {row['averaging_kib_per_peer']:.1f} KiB/peer averaging "
              f"({row['averaging_kib_per_peer'] / vector_kib:.2f} x), {row['matchmaking_kib_per_peer']:.1f} KiB/peer "
              f"matchmaking, {row['virtual_s']:.1f} virtual s")
        if row["failures"]:
            print(f"      failures: {row['failures']}")
    print(f"wall time {out['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
