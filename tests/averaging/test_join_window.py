"""A leader's join window restarts with every arrival (issue #20).

The Moshpit simulation (scripts/bench/sim_averaging.py) found groups of 16 peers that all wanted
the same group splitting into a 3 and a 13 at WAN latencies: followers reach the leader spread
over a few round trips (their DHT declarations and lookups), and the leader started its group
`join_window` after it first had `min_group_size` members, however many were still arriving.

The real `Matchmaking` runs here on simulated links and virtual time (scripts/bench/simnet.py),
so the arrival times are exact and the test takes milliseconds.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

from swarm.averaging import MatchmakingConfig, MemberInfo
from swarm.averaging.election import StaticElection
from swarm.averaging.matchmaking import Matchmaking
from swarm.core.errors import AveragingError
from swarm.core.identity import Identity

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import simnet  # scripts/bench is no package


def _peers(n: int) -> list[simnet.SimPeer]:
    net = simnet.SimNetwork(random.Random(0))
    peers = [simnet.SimPeer(net, Identity.from_seed(bytes([i + 1]) * 32)) for i in range(n)]
    for peer in peers:
        net.rtt[peer.peer_id] = 0.02  # every link: 20 ms round trip
        peer.server.start_serving()
    return sorted(peers, key=lambda p: p.peer_id)  # the smallest PeerID leads a static group


async def _form_groups(peers: list[simnet.SimPeer], arrivals: list[float], config: MatchmakingConfig) -> list[object]:
    """Each peer's group size, or the error its step raised."""
    election_addrs = [p.addrs[0] for p in peers]
    makers = [Matchmaking(p, "run", b"schema", 16, StaticElection(election_addrs), config) for p in peers]

    async def step(i: int) -> int:
        await asyncio.sleep(arrivals[i])
        me = MemberInfo(peers[i].peer_id, peers[i].addrs[0])
        group = await makers[i].form_group(me, timeout=20.0)
        return len(group.members)

    return list(await asyncio.gather(*(step(i) for i in range(len(peers))), return_exceptions=True))


def test_followers_arriving_within_the_window_of_each_other_all_make_the_group() -> None:
    """The leader is in at once; five followers arrive 0.2 s apart, each within the 0.3 s window
    of the previous one: one group of all six forms, 0.3 s after the last arrival."""
    peers = _peers(6)
    config = MatchmakingConfig(target_group_size=8, min_group_size=2, join_window=0.3)
    arrivals = [0.0, 0.0, 0.2, 0.4, 0.6, 0.8]

    async def main() -> tuple[list[object], float]:
        sizes = await _form_groups(peers, arrivals, config)
        return sizes, asyncio.get_running_loop().time()

    sizes, end = simnet.run(main())
    assert sizes == [6] * 6
    assert 1.1 <= end <= 1.2  # last arrival (0.8 s + 10 ms) + the 0.3 s window + the answer's 10 ms


def test_a_follower_later_than_the_window_is_left_for_the_next_group() -> None:
    """The window still bounds the wait: a follower 1.3 s after the last one misses the group (and,
    alone, forms none)."""
    peers = _peers(4)
    config = MatchmakingConfig(target_group_size=8, min_group_size=2, join_window=0.3)
    arrivals = [0.0, 0.0, 0.2, 1.5]

    async def main() -> list[object]:
        return await _form_groups(peers, arrivals, config)

    sizes = simnet.run(main())
    assert sizes[:3] == [3, 3, 3]
    assert isinstance(sizes[3], AveragingError)
