"""Who leads a group that is forming: the `Election` that `matchmaking.Matchmaking` asks.

Two elections:

- `StaticElection`: a fixed list of peers' multiaddrs; the peer with the smallest PeerID that
  is not known to be down leads (useful for tests and benchmarks);
- `DHTElection`: peers declare themselves under ``{prefix}.group.{group_key}`` (subkey: their
  `swarm.dht.owner_marker`, so a declaration is signed by its peer and no one else can overwrite
  or forge it; readers ignore other subkeys; expiration: when they give up waiting); the live
  declaration that expires first leads, because that peer must start soonest (as in hivemind's matchmaking). A vanished leader is
  skipped after one failed call; a leader that sees an earlier one appear steps down.

In both, a peer reached through a relay leads only when no candidate is reached directly (every
member talks to the leader; docs/relay.md).

Both say who else is coming (`declared`): a leader waits for those peers (see `matchmaking`).
A DHT declaration carries when its peer will be ready (``ready_at``, DHT time) and whether it
is looking for a group now; `DHTElection.announce` declares a peer ahead of its step (e.g. when
training progress says when it will be ready) without making it a candidate to lead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from swarm.averaging.group import MemberInfo
from swarm.core.errors import ConfigError
from swarm.core.loop import spawn
from swarm.core.multiaddr import Multiaddr, is_relayed
from swarm.core.timeutil import get_dht_time
from swarm.dht.expiring import subkey_entries
from swarm.dht.handle import KeyValueStore
from swarm.dht.validation import marker_owner, owner_marker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """A peer that may lead: its PeerID and where to dial it."""

    peer_id: str
    addr: str


@dataclass(frozen=True)
class Declaration:
    """A peer known to want this group.

    Attributes:
        peer_id: its PeerID.
        ready_at: DHT time at which it said it will be ready (0: now).
        looking: it is in its step now (not only announced).
    """

    peer_id: str
    ready_at: float = 0.0
    looking: bool = True


class Election(Protocol):
    """Decides who leads the group this peer is looking for.

    `read_seconds`: the slowest exchange with the declarations in this step, this peer's own
    declaration's store included (a leader's join window covers it: followers store and read the
    same declarations, as slowly, so a follower that declared just before the window closed is
    visible to the leader's last look).
    """

    read_seconds: float
    fixed: bool
    """The leader is fixed by a list of members, not by who declares: a join that comes before
    this peer's step is held for it, and members the list does not name (client mode) may come."""
    group_key: str
    """The group this peer looks for (see `moshpit_group_key`)."""
    started: dict[str, str]
    """PeerID -> round id (hex) of peers whose declarations say a group of this round started."""

    @property
    def round_key(self) -> str:
        """The key of this step's round where keys name rounds (a key given to the step), else ""."""

    def name_round(self, group_key: str | None) -> None:
        """Sets the key of the step about to begin: a key given names its round (None: the
        averager's own key, reused from step to step)."""

    async def begin(self, me: MemberInfo, deadline_wall: float) -> None:
        """Called once per step before looking for a leader (e.g. declare in the DHT)."""

    async def announce(self, me: MemberInfo, ready_at: float, expiration: float, group_key: str | None = None) -> bool:
        """Declares ahead that this peer will look for the group (`group_key`, else its own) at
        `ready_at` (DHT time), until `expiration`; False where nothing is declared."""

    async def outranked(self, me: MemberInfo, down: set[str], answers: Callable[[Candidate], Awaitable[bool]]) -> bool:
        """Whether another peer should lead now, while this one leads: an earlier declaration
        appeared, or a peer taken for down (and so led in its place) `answers` again (it is then
        taken off `down`)."""

    async def leader(self, me: MemberInfo, down: set[str]) -> Candidate | None:
        """The peer that should lead now (None: no leader known yet), skipping `down` peers."""

    async def end(self, me: MemberInfo, started: bytes | None = None) -> None:
        """Called when the step found a group (the round id in `started`) or gave up."""

    def declared(self, me: MemberInfo) -> dict[str, Declaration]:
        """Other peers known to want this group, as of the last look (`leader` or `refresh`)."""

    async def refresh(self, me: MemberInfo) -> None:
        """Looks again at who wants this group (a no-op where that is fixed)."""

    def patience(self) -> float:
        """Seconds a declared peer may be late beyond its learned lateness because its reads of
        the declarations still wait on nodes this peer already saw die (0 where nothing is read)."""


class StaticElection:
    """A fixed set of peers; the smallest PeerID not known to be down leads (a direct one first).

    Args:
        addrs: multiaddrs (with /p2p/<PeerID>) of the other server-mode members; may include this peer's own.
    """

    fixed = True

    def __init__(self, addrs: Sequence[str]) -> None:
        self.read_seconds = 0.0  # the members are known: nothing to read
        self.group_key = "0"  # one group: keys name nothing
        self.started: dict[str, str] = {}  # nobody declares, so nobody says it started
        self.candidates: dict[str, Candidate] = {}
        for addr in addrs:
            parsed = Multiaddr.parse(addr)
            if not parsed.peer_id:
                raise ConfigError(f"static group address {addr} must end with /p2p/<PeerID>")
            self.candidates[parsed.peer_id] = Candidate(parsed.peer_id, addr)

    @property
    def round_key(self) -> str:
        return ""

    def name_round(self, group_key: str | None) -> None:
        return None

    async def begin(self, me: MemberInfo, deadline_wall: float) -> None:
        if me.is_reducer:
            self.candidates.setdefault(me.peer_id, Candidate(me.peer_id, me.addr))

    async def announce(self, me: MemberInfo, ready_at: float, expiration: float, group_key: str | None = None) -> bool:
        return False  # the leader expects every member anyway

    async def outranked(self, me: MemberInfo, down: set[str], answers: Callable[[Candidate], Awaitable[bool]]) -> bool:
        for peer_id in sorted(down):
            candidate = self.candidates.get(peer_id)
            if candidate is None or peer_id > me.peer_id:
                continue
            if await answers(candidate):
                down.discard(peer_id)
                return True
        return False

    async def leader(self, me: MemberInfo, down: set[str]) -> Candidate | None:
        alive = sorted((is_relayed(c.addr), pid) for pid, c in self.candidates.items() if pid not in down)
        return self.candidates[alive[0][1]] if alive else None

    async def end(self, me: MemberInfo, started: bytes | None = None) -> None:
        return None

    def declared(self, me: MemberInfo) -> dict[str, Declaration]:
        # every member of a static group is expected at every step
        return {pid: Declaration(pid) for pid in self.candidates if pid != me.peer_id}

    async def refresh(self, me: MemberInfo) -> None:
        return None

    def patience(self) -> float:
        return 0.0


class DHTElection:
    """Leader election through DHT declarations under ``{prefix}.group.{group_key}``.

    Args:
        dht: an object with ``astore(key, value, expiration_time, subkey=None)`` and
            ``aget(key, latest=False)`` (`swarm.dht` on `peer.dht`).
        prefix: the averager's prefix.
        group_key: which group to look for (see `moshpit_group_key`).
    """

    fixed = False

    def __init__(self, dht: KeyValueStore, prefix: str, group_key: str = "0") -> None:
        self.dht = dht
        self.prefix = prefix
        self.group_key = group_key
        self._expiration = 0.0
        self._began = 0.0
        self._declared: dict[str, Declaration] = {}
        self._leaders: dict[str, tuple[float, str]] = {}
        self.started: dict[str, str] = {}
        """PeerID -> round id (hex) of peers whose declaration says they started a group."""
        self._withdrawal: asyncio.Task[None] | None = None  # `end`'s store, still running
        self._declaring: asyncio.Task[None] | None = None  # `begin`'s store, still running
        self.names_round = False
        """Whether `group_key` names one round (e.g. an epoch) rather than being reused by every step."""
        self.read_seconds = 0.0
        """The slowest store or read of the declarations in this step (a read waits out a dead replica)."""

    @property
    def key(self) -> str:
        return f"{self.prefix}.group.{self.group_key}"

    @property
    def round_key(self) -> str:
        return self.group_key if self.names_round else ""

    def name_round(self, group_key: str | None) -> None:
        self.names_round = group_key is not None
        if group_key is not None:
            self.group_key = group_key

    async def begin(self, me: MemberInfo, deadline_wall: float) -> None:
        if self._withdrawal is not None:  # the last step's withdrawal lands before this declaration
            await asyncio.gather(self._withdrawal, return_exceptions=True)
        self._expiration = deadline_wall
        self._declared, self._leaders, self.started = {}, {}, {}
        self.read_seconds = 0.0
        self._began = get_dht_time()
        value = {"addr": me.addr, "client_mode": me.client_mode, "ready_at": self._began, "looking": True}
        # The store runs beside this step's first reads, not before them: its lookup may wait one
        # request timeout on a dead node near the key that this peer has not met yet, and a
        # follower whose first read already names the leader joins it then (the join is what the
        # leader counts). A step that leads meanwhile counts itself (`leader`).
        self._declaring = spawn(self._declare(value, deadline_wall, me.peer_id), "averaging-declare")

    async def _declare(self, value: dict[str, object], expiration: float, peer_id: str) -> None:
        began, key = self._began, self.key
        try:
            ok = await self.dht.astore(key, value, expiration_time=expiration, subkey=owner_marker(peer_id))
        except Exception:  # the step goes on; a declaration that never lands costs only visibility
            logger.debug("could not declare under %s", key, exc_info=True)
            return
        took = get_dht_time() - began
        if self._began == began:  # still this step: the window covers the slowest store too
            self.read_seconds = max(self.read_seconds, took)
        logger.debug("%s under %s in %.3f s", "declared" if ok else "declaration not stored", key, took)

    async def announce(self, me: MemberInfo, ready_at: float, expiration: float, group_key: str | None = None) -> bool:
        """Declares that this peer will look for this group (or group `group_key` of the same
        prefix) at `ready_at` (DHT time), until `expiration`.

        A leader then waits for it (up to its learned bound past `ready_at`); it is no candidate
        to lead before its step declares it again (`begin`, which must expire later).
        """
        key = self.key if group_key is None else f"{self.prefix}.group.{group_key}"
        value = {"addr": me.addr, "client_mode": me.client_mode, "ready_at": ready_at, "looking": False}
        return bool(await self.dht.astore(key, value, expiration_time=expiration, subkey=owner_marker(me.peer_id)))

    async def outranked(self, me: MemberInfo, down: set[str], answers: Callable[[Candidate], Awaitable[bool]]) -> bool:
        leader = await self.leader(me, down)
        return leader is not None and leader.peer_id != me.peer_id

    async def leader(self, me: MemberInfo, down: set[str]) -> Candidate | None:
        await self.refresh(me)
        entries: list[tuple[float, str, str]] = [
            (expiration, peer_id, addr) for peer_id, (expiration, addr) in self._leaders.items() if peer_id not in down]
        if me.is_reducer and me.peer_id not in down and not any(pid == me.peer_id for _, pid, _ in entries):
            entries.append((self._expiration, me.peer_id, me.addr))  # our own store may not be visible yet
        if not entries:
            return None
        _, peer_id, addr = min(entries, key=lambda entry: (is_relayed(entry[2]), entry))
        return Candidate(peer_id, addr)

    def declared(self, me: MemberInfo) -> dict[str, Declaration]:
        return {pid: d for pid, d in self._declared.items() if pid != me.peer_id}

    def patience(self) -> float:
        # this peer's reads pass over nodes it saw time out; a follower that has not met them yet
        # waits one request timeout on them first (seen with 256 simulated peers, BENCHMARKS.md)
        return self.dht.read_patience()

    async def refresh(self, me: MemberInfo) -> None:
        asked = get_dht_time()
        found = await self.dht.aget(self.key, latest=True)
        now = get_dht_time()
        self.read_seconds = max(self.read_seconds, now - asked)
        if now - asked > 1.0:
            logger.debug("a read of %s took %.3f s", self.key, now - asked)
        declared: dict[str, Declaration] = {}
        leaders: dict[str, tuple[float, str]] = {}
        for subkey, item in subkey_entries(found).items():
            peer_id = marker_owner(subkey)  # signed by that peer; other subkeys anyone may write
            value, expiration = item.value, item.expiration_time
            if peer_id is None or not isinstance(value, dict) or expiration <= now:
                continue
            if value.get("done"):
                at = value.get("at", 0.0)
                # a key that names one round: any group under it is of that round; a key reused
                # from step to step: only a group that started during this step
                recent = self.names_round or (isinstance(at, (int, float)) and at >= self._began)
                if isinstance(value.get("started"), str) and recent:
                    self.started[peer_id] = value["started"]
                continue
            ready_at = value.get("ready_at", 0.0)
            looking = value.get("looking", True) is not False
            declared[peer_id] = Declaration(
                peer_id, float(ready_at) if isinstance(ready_at, (int, float)) else 0.0, looking)
            if looking and not value.get("client_mode") and value.get("addr"):
                leaders[peer_id] = (float(expiration), str(value["addr"]))
        self._declared, self._leaders = declared, leaders

    async def end(self, me: MemberInfo, started: bytes | None = None) -> None:
        """Withdraws the declaration: a later expiration replaces it with one that says this peer
        stopped looking (and, when it is in a group, which round: a peer that missed it learns so
        from here). The store runs in the background: the round must not wait on it (a dead
        node among the key's closest would hold every member's start); the next `begin` waits for it."""
        value: dict[str, object] = {"addr": me.addr, "client_mode": me.client_mode, "done": True}
        if started is not None:
            value["started"], value["at"] = started.hex(), get_dht_time()
        key, expiration = self.key, self._expiration + 0.001

        async def withdraw() -> None:
            started_at = get_dht_time()
            try:
                await self.dht.astore(key, value, expiration_time=expiration, subkey=owner_marker(me.peer_id))
            except Exception:  # best effort; it expires on its own anyway
                logger.debug("could not withdraw the declaration under %s", key, exc_info=True)
            logger.debug("withdrew the declaration under %s in %.3f s", key, get_dht_time() - started_at)

        self._withdrawal = spawn(withdraw(), "averaging-withdraw")
