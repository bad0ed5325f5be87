"""A synthetic swarm for the dashboard: as many peers, experts and runs as asked, no network.

It feeds `Picture` (the snapshot and its history) the inputs a collector would read (peers'
answers with what they say of themselves, progress reports, expert declarations), so a benchmark
measures the real snapshot and page at any size (scripts/bench/bench_dashboard.py) and a test can
put any string a hostile peer might report on the page. Each `acollect` moves the swarm on: epochs rise, the loss falls, peers' RTTs change.
"""

from __future__ import annotations

import math

from swarm.core.timeutil import get_dht_time
from swarm.dashboard import view
from swarm.optim.progress import PeerProgress, RoundSummary

__all__ = ["SyntheticSwarm"]

_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _peer_id(i: int) -> str:
    digits = []
    for _ in range(44):
        i, r = divmod(i * 7919 + 104729, 58)
        digits.append(_BASE58[r])
    return "12D3KooW" + "".join(digits)


class SyntheticSwarm:
    """A `SnapshotSource` with `peers` peers (the first `servers` of them serve the experts),
    `experts` experts in grids of 100 x 100, and `runs` training runs of `trainers` peers each.

    Args:
        text: put this string wherever a peer reports free text (run ids, roles, versions, uids),
            as a hostile peer would; None for ordinary values.
    """

    def __init__(self, peers: int = 200, experts: int = 10_000, runs: int = 1, trainers: int = 100,
                 servers: int = 50, text: str | None = None, limits: view.DashboardLimits | None = None) -> None:
        if min(peers, servers) < 1 or experts < 0 or runs < 0 or trainers < 0:
            raise ValueError("a synthetic swarm needs at least one peer and one server")
        self.ids = [_peer_id(i) for i in range(peers)]
        self.servers = min(servers, peers)
        self.text = text
        self.picture = view.Picture(limits or view.DashboardLimits())
        self.history = self.picture.history
        self.tick = 0
        grids = max(1, math.ceil(experts / 10_000))
        uids = [f"{'g' if text is None else text}{g}.{i // 100}.{i % 100}" for g in range(grids)
                for i in range(min(10_000, experts - g * 10_000))]
        self.declared = [view.ExpertDeclaration(uid, self.ids[n % self.servers]) for n, uid in enumerate(uids)]
        self.run_ids = [f"run-{r}" if text is None else f"{text}{r}" for r in range(runs)]
        self.trainers = (self.ids[self.servers:] or self.ids)[:trainers]
        self.trainer_set = set(self.trainers)
        self.loads: dict[str, list[tuple[str, int, int]]] = {}
        self.links = [tuple(view.LinkMeasure(self.ids[(i + j) % peers], 1.0 + (i + j) % 30, (1 + i * j % 50) * 1e6)
                            for j in range(1, 17)) for i in range(peers)]  # what each measured of 16 others
        self.started = get_dht_time()

    async def acollect(self) -> view.Snapshot:
        self.tick += 1
        now = self.started + 2.0 * self.tick
        if self.tick % 5 == 1:  # the servers' loads move on as often as the grid is read again (below)
            self.loads = {}
            for n, d in enumerate(self.declared):
                self.loads.setdefault(d.server, []).append((d.uid, self.tick * (1 + n % 5), n % 3))
        answers = [self._answer(i, pid, self.loads.get(pid, [])) for i, pid in enumerate(self.ids)]
        runs = [view.RunReports(run_id, tuple(
            PeerProgress(pid, self.tick // 3, (self.tick * 16 + j) % 512, 30.0 + j % 7, now,
                         loss=2.0 + 3.0 / (1 + self.tick / 10) + 0.01 * (j % 5), target_batch_size=512,
                         last_round=RoundSummary(self.tick // 3, j % 17 != 0, 4, 4 - (j % 23 == 0), 0.3))
            for j, pid in enumerate(self.trainers))) for run_id in self.run_ids]
        # the grid (and its loads) is taken again every 5th collection, as the collector walks the grids less often
        return self.picture.snapshot(now, self.ids[0], answers, runs, self.declared, (self.tick - 1) // 5)

    def _answer(self, i: int, pid: str, loads: list[tuple[str, int, int]]) -> view.PeerAnswer:
        free = self.text if self.text is not None else ""
        rejected = ((self.ids[(i + 1) % self.servers], 1 + self.tick % 4),) if i % 10 == 0 else ()
        return view.PeerAnswer(
            pid, answered=(i + self.tick) % 37 != 0, role=free or "peer", version=free or "0.2.0",
            reachability=("public", "private", "unknown")[i % 3], client_mode=i % 11 == 0,
            rtt_ms=1.0 + (i * 13 + self.tick) % 40, first_seen=self.started, uptime_s=3600.0 + 2.0 * self.tick + i,
            links=self.links[i], runs=tuple(free or r for r in self.run_ids[:8]) if pid in self.trainer_set else (),
            expert_load=tuple(loads), forward_ms=2.0 + i % 9 if i < self.servers else None, rejected=rejected)

    def history_json(self) -> view.Snapshot:
        return self.history.to_json()
