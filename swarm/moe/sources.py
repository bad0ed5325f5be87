"""Where a client learns which experts are alive and where they are served.

`ExpertSource` is what the beam search (`swarm.moe.client.beam_search`) and `RemoteExpert` ask:
the live successors of grid prefixes, and the addresses of whole UIDs. The DHT answers it in
a swarm (`swarm.moe.dht_declare.DHTExpertSource`); `StaticExpertSource` answers it from a fixed
table, for setups without a DHT (a private cluster, tests, benchmarks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from swarm.moe.uids import Successors, parse_uid, successor_coord, uid_prefixes

__all__ = ["ExpertSource", "StaticExpertSource"]

class ExpertSource(Protocol):
    """Tells which experts are alive and where. Every method runs on the peer's event loop."""

    async def get_successors(self, prefixes: Sequence[str]) -> dict[str, Successors]:
        """For each prefix such as ``"ffn.3."``, the live coordinates that follow it.

        Prefixes with no live successor may be missing from the answer or map to ``{}``.
        """
        ...

    async def get_experts(self, uids: Sequence[str]) -> dict[str, str]:
        """The address of each live expert among `uids` (dead or unknown ones are left out)."""
        ...

    async def get_replicas(self, uids: Sequence[str]) -> dict[str, list[str]]:
        """Every live server of each expert among `uids`, the one `get_experts` gives first (an
        expert served by several servers can be spot-checked: `swarm.moe.client.spot_checks`)."""
        ...


class StaticExpertSource:
    """An `ExpertSource` over a fixed ``{uid: address}`` table.

    Args:
        experts: the experts and the multiaddr (ending in /p2p/<PeerID>) of each one's server. As
            pairs, a UID may come several times: it is served by several servers (replicas), the
            first one given is the one a mixture calls, the others answer its spot checks.
    """

    def __init__(self, experts: Mapping[str, str] | Iterable[tuple[str, str]]) -> None:
        items = experts.items() if isinstance(experts, Mapping) else experts
        self.experts: dict[str, str] = {}
        self.replicas: dict[str, list[str]] = {}
        for uid, addr in items:
            parse_uid(uid)
            self.experts.setdefault(uid, addr)
            if addr not in self.replicas.setdefault(uid, []):
                self.replicas[uid].append(addr)

    async def get_successors(self, prefixes: Sequence[str]) -> dict[str, Successors]:
        wanted = set(prefixes)
        found: dict[str, Successors] = {p: {} for p in wanted}
        for uid, addr in self.experts.items():
            for prefix in uid_prefixes(uid):
                if prefix in wanted:
                    coord = successor_coord(prefix, uid)
                    if coord is not None:
                        found[prefix].setdefault(coord, (uid, addr))
        return found

    async def get_experts(self, uids: Sequence[str]) -> dict[str, str]:
        return {uid: self.experts[uid] for uid in uids if uid in self.experts}

    async def get_replicas(self, uids: Sequence[str]) -> dict[str, list[str]]:
        return {uid: list(self.replicas[uid]) for uid in uids if uid in self.replicas}
