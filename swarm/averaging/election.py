"""Who leads a group that is forming: the `Election` that `matchmaking.Matchmaking` asks.

Two elections:

- `StaticElection`: a fixed list of peers' multiaddrs; the peer with the smallest PeerID that
  is not known to be down leads (useful for tests and benchmarks);
- `DHTElection`: peers declare themselves under ``{prefix}.group.{group_key}`` (subkey: their
  PeerID; expiration: when they give up waiting); the live declaration that expires first leads,
  because that peer must start soonest (as in hivemind's matchmaking). A vanished leader is
  skipped after one failed call; a leader that sees an earlier one appear steps down.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from swarm.averaging.group import MemberInfo
from swarm.core.errors import ConfigError
from swarm.core.multiaddr import Multiaddr
from swarm.core.timeutil import get_dht_time
from swarm.dht.handle import KeyValueStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """A peer that may lead: its PeerID and where to dial it."""

    peer_id: str
    addr: str


class Election(Protocol):
    """Decides who leads the group this peer is looking for."""

    async def begin(self, me: MemberInfo, deadline_wall: float) -> None:
        """Called once per step before looking for a leader (e.g. declare in the DHT)."""

    async def leader(self, me: MemberInfo, down: set[str]) -> Candidate | None:
        """The peer that should lead now (None: no leader known yet), skipping `down` peers."""

    async def end(self, me: MemberInfo) -> None:
        """Called when the step found a group or gave up."""


class StaticElection:
    """A fixed set of peers; the smallest PeerID not known to be down leads.

    Args:
        addrs: multiaddrs (with /p2p/<PeerID>) of the other server-mode members; may include this peer's own.
    """

    def __init__(self, addrs: Sequence[str]) -> None:
        self.candidates: dict[str, Candidate] = {}
        for addr in addrs:
            parsed = Multiaddr.parse(addr)
            if not parsed.peer_id:
                raise ConfigError(f"static group address {addr} must end with /p2p/<PeerID>")
            self.candidates[parsed.peer_id] = Candidate(parsed.peer_id, addr)

    async def begin(self, me: MemberInfo, deadline_wall: float) -> None:
        if me.is_reducer:
            self.candidates.setdefault(me.peer_id, Candidate(me.peer_id, me.addr))

    async def leader(self, me: MemberInfo, down: set[str]) -> Candidate | None:
        alive = sorted(pid for pid in self.candidates if pid not in down)
        return self.candidates[alive[0]] if alive else None

    async def end(self, me: MemberInfo) -> None:
        return None


class DHTElection:
    """Leader election through DHT declarations under ``{prefix}.group.{group_key}``.

    Args:
        dht: an object with ``astore(key, value, expiration_time, subkey=None)`` and
            ``aget(key, latest=False)`` (`swarm.dht` on `peer.dht`).
        prefix: the averager's prefix.
        group_key: which group to look for (see `moshpit_group_key`).
    """

    def __init__(self, dht: KeyValueStore, prefix: str, group_key: str = "0") -> None:
        self.dht = dht
        self.prefix = prefix
        self.group_key = group_key
        self._expiration = 0.0

    @property
    def key(self) -> str:
        return f"{self.prefix}.group.{self.group_key}"

    async def begin(self, me: MemberInfo, deadline_wall: float) -> None:
        self._expiration = deadline_wall
        value = {"addr": me.addr, "client_mode": me.client_mode}
        ok = await self.dht.astore(self.key, value, expiration_time=deadline_wall, subkey=me.peer_id)
        if not ok:
            logger.debug("declaration under %s was not stored", self.key)

    async def leader(self, me: MemberInfo, down: set[str]) -> Candidate | None:
        found = await self.dht.aget(self.key, latest=True)
        now = get_dht_time()
        entries: list[tuple[float, str, str]] = []
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                value = getattr(item, "value", None)
                expiration = getattr(item, "expiration_time", 0.0)
                if not isinstance(subkey, str) or not isinstance(value, dict) or expiration <= now:
                    continue
                if value.get("client_mode") or value.get("done") or not value.get("addr") or subkey in down:
                    continue
                entries.append((float(expiration), subkey, str(value["addr"])))
        if me.is_reducer and me.peer_id not in down and not any(pid == me.peer_id for _, pid, _ in entries):
            entries.append((self._expiration, me.peer_id, me.addr))  # our own store may not be visible yet
        if not entries:
            return None
        _, peer_id, addr = min(entries)
        return Candidate(peer_id, addr)

    async def end(self, me: MemberInfo) -> None:
        # withdraw: a later expiration replaces our declaration with one that says we stopped looking
        try:
            await self.dht.astore(self.key, {"addr": me.addr, "client_mode": me.client_mode, "done": True},
                                  expiration_time=self._expiration + 0.001, subkey=me.peer_id)
        except Exception:  # best effort; it expires on its own anyway
            logger.debug("could not withdraw the declaration under %s", self.key, exc_info=True)
