"""Matchmaking: how peers that want to average find a group and agree on who leads it.

A group forms around a leader. Followers call the leader's ``Join`` RPC, a long poll that is
answered with the group once it forms, so client-mode peers (which only dial out) join the same
way. The leader starts as soon as `target_group_size` members are in, or, once
`min_group_size` is met, after a short `join_window` without new arrivals (never always waiting
out a fixed window). A joiner whose call is gone (it died or gave up) is left out.

Who leads comes from an `Election`:

- `StaticElection`: a fixed list of peers' multiaddrs; the peer with the smallest PeerID that
  is not known to be down leads (useful for tests and benchmarks);
- `DHTElection`: peers declare themselves under ``{prefix}.group.{group_key}`` (subkey: their
  PeerID; expiration: when they give up waiting); the live declaration that expires first leads,
  because that peer must start soonest (as in hivemind's matchmaking). A vanished leader is
  skipped after one failed call; a leader that sees an earlier one appear steps down.

`moshpit_group_key` gives Moshpit SGD's group keys (Ryabinin et al., 2021, §3.2): peers sit in a
virtual grid and, in round t, group with the peers that share all their coordinates except
coordinate t mod d, so hundreds of peers form many small groups that mix across rounds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from swarm.averaging.group import GroupInfo, MemberInfo
from swarm.averaging.service import JOIN, AveragingService
from swarm.core.errors import AveragingError, ConfigError, DeadlineExceeded, PeerUnreachable, RPCError
from swarm.core.multiaddr import Multiaddr
from swarm.core.timeutil import get_dht_time
from swarm.net.server import CallContext
from swarm.proto import averaging_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MatchmakingConfig:
    """How groups form.

    Attributes:
        target_group_size: the leader starts as soon as this many members are in.
        min_group_size: fewest members a round may have.
        join_window: once `min_group_size` is met, how long the leader waits for one more arrival.
        matchmaking_share: at most this share of a step's timeout goes to forming a group when
            `min_group_size` is met (the rest is for the all-reduce).
        retry_interval: pause before a follower asks again after a leader refused it.
        poll_interval: how often a waiting DHT leader checks that it still leads.
    """

    target_group_size: int = 4
    min_group_size: int = 2
    join_window: float = 0.3
    matchmaking_share: float = 0.5
    retry_interval: float = 0.05
    poll_interval: float = 0.5

    def __post_init__(self) -> None:
        if self.min_group_size < 1 or self.target_group_size < self.min_group_size:
            raise ConfigError("need 1 <= min_group_size <= target_group_size")
        if self.join_window < 0 or not 0 < self.matchmaking_share < 1:
            raise ConfigError("need join_window >= 0 and 0 < matchmaking_share < 1")
        if self.retry_interval <= 0 or self.poll_interval <= 0:
            raise ConfigError("retry_interval and poll_interval must be > 0")


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

    def __init__(self, dht: Any, prefix: str, group_key: str = "0") -> None:
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


def moshpit_group_key(round_number: int, coords: Sequence[int]) -> str:
    """Moshpit SGD group key: in round t, peers that share every grid coordinate except t mod d.

    Args:
        round_number: the averaging round (the same on every peer, e.g. the training epoch).
        coords: this peer's coordinates in the virtual grid (d = len(coords)).

    Returns:
        A key naming the dimension averaged this round and the other coordinates.
    """
    if not coords:
        return "0"
    dim = round_number % len(coords)
    rest = ".".join(str(c) for i, c in enumerate(coords) if i != dim)
    return f"d{dim}.{rest}" if rest else f"d{dim}"


def moshpit_next_coords(round_number: int, coords: Sequence[int], index_in_group: int, grid: Sequence[int]) -> list[int]:
    """After a round, a peer's coordinate along the averaged dimension becomes its index in the group,
    so the members of one group spread to different groups in the next rounds (Moshpit §3.2)."""
    if len(coords) != len(grid):
        raise ValueError("coords and grid must have the same length")
    new = list(coords)
    dim = round_number % len(coords)
    new[dim] = index_in_group % grid[dim]
    return new


def random_coords(grid: Sequence[int], rng: random.Random | None = None) -> list[int]:
    rng = rng or random.Random()
    return [rng.randrange(size) for size in grid]


@dataclass
class _Joiner:
    member: MemberInfo
    timeout_at: float  # loop time
    answer: asyncio.Future[averaging_pb2.JoinResponse]


class Matchmaking:
    """Forms groups for one averager (one prefix) on one peer.

    Args:
        peer: the local peer.
        prefix: the averager's prefix.
        schema: digest of the tensors' shapes and dtypes.
        numel: length of the averaged flat vector.
        election: who leads.
        config: group sizes and waits.
        compression: wire codec written into groups this peer leads.
        chunk_bytes: chunk size written into groups this peer leads.
    """

    def __init__(
        self, peer: Any, prefix: str, schema: bytes, numel: int, election: Election,
        config: MatchmakingConfig | None = None, compression: int = 0, chunk_bytes: int = 1 << 20,
    ) -> None:
        self.peer, self.prefix, self.schema, self.numel = peer, prefix, schema, numel
        self.election = election
        self.config = config or MatchmakingConfig()
        self.compression, self.chunk_bytes = compression, chunk_bytes
        self._joiners: dict[str, _Joiner] = {}
        self._arrived = asyncio.Event()
        self._looking: MemberInfo | None = None
        self._leading = False
        self._start_size = self.config.target_group_size
        self._down: set[str] = set()
        AveragingService.of(peer).join_handlers[prefix] = self.rpc_join

    def close(self) -> None:
        AveragingService.of(self.peer).join_handlers.pop(self.prefix, None)
        for joiner in self._joiners.values():
            if not joiner.answer.done():
                joiner.answer.set_result(averaging_pb2.JoinResponse(accepted=False, reason="leader shut down"))

    # -- follower side -----------------------------------------------------------------------

    async def form_group(self, me: MemberInfo, timeout: float, expected_size: int | None = None) -> GroupInfo:
        """Finds (or leads) a group within `timeout` seconds; raises `AveragingError` if none forms.

        `expected_size`: how many peers are known to want this group (e.g. from training progress
        records); if this peer leads, it starts as soon as that many are in (within the
        configured min and target sizes) instead of waiting for the target size.
        """
        loop = asyncio.get_running_loop()
        cfg = self.config
        self._start_size = cfg.target_group_size if expected_size is None else max(
            cfg.min_group_size, min(expected_size, cfg.target_group_size))
        start = loop.time()
        deadline = start + timeout
        self._down = set()
        self._looking = me
        await self.election.begin(me, get_dht_time() + timeout)
        try:
            while loop.time() < deadline:
                candidate = await self.election.leader(me, self._down)
                if candidate is None:
                    await asyncio.sleep(self.config.retry_interval)
                    continue
                if candidate.peer_id == me.peer_id:
                    self._leading = True
                    try:
                        group = await self._lead(me, start, deadline)
                    finally:
                        self._leading = False
                    if group is not None:
                        return group
                    continue
                # we follow someone else: whoever asked us to lead must look again
                self._refuse_all("not the leader")
                group = await self._follow(me, candidate, deadline)
                if group is not None:
                    return group
            raise AveragingError(f"no averaging group formed within {timeout:.1f} s")
        finally:
            self._looking = None
            await self.election.end(me)

    async def _follow(self, me: MemberInfo, leader: Candidate, deadline: float) -> GroupInfo | None:
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        request = averaging_pb2.JoinRequest(
            prefix=self.prefix, schema=self.schema, numel=self.numel, member=me.to_proto(), timeout=remaining,
        )
        try:
            response = await self.peer.pool.get(leader.addr).unary(
                JOIN, request, averaging_pb2.JoinResponse, timeout=max(0.01, remaining)
            )
        except PeerUnreachable as e:
            logger.debug("leader %s is down: %s", leader.peer_id[-8:], e)
            self._down.add(leader.peer_id)
            return None
        except RPCError as e:  # slow or refusing, not gone: ask again rather than lead without it
            logger.debug("join at %s failed: %s", leader.peer_id[-8:], e)
            if isinstance(e, DeadlineExceeded) and loop.time() >= deadline - 0.05:
                return None
            await asyncio.sleep(self.config.retry_interval * (1 + random.random()))
            return None
        if response.accepted:
            group = GroupInfo.from_proto(response.group)
            if group.prefix != self.prefix or me.peer_id not in group.peer_ids or group.leader.peer_id != leader.peer_id:
                logger.warning("leader %s sent a group that does not match the request", leader.peer_id[-8:])
                self._down.add(leader.peer_id)
                return None
            return group
        logger.debug("leader %s refused: %s", leader.peer_id[-8:], response.reason)
        if response.reason == "not the leader":
            self._down.clear()  # our view of who is down may be what sent us there: look again
        if "schema" in response.reason:
            raise AveragingError(f"leader {leader.peer_id} averages other tensors: {response.reason}")
        await asyncio.sleep(self.config.retry_interval * (1 + random.random()))
        return None

    # -- leader side -------------------------------------------------------------------------

    async def rpc_join(self, request: averaging_pb2.JoinRequest, ctx: CallContext) -> averaging_pb2.JoinResponse:
        """A follower asks to be in this peer's next group (answered when the group forms)."""
        if request.schema != self.schema or request.numel != self.numel:
            return averaging_pb2.JoinResponse(accepted=False, reason="schema mismatch: different tensors")
        try:
            member = MemberInfo.from_proto(request.member)
        except ConfigError as e:
            return averaging_pb2.JoinResponse(accepted=False, reason=f"bad member: {e}")
        if member.peer_id != ctx.peer_id:
            return averaging_pb2.JoinResponse(accepted=False, reason="a peer may only join as itself")
        if not self._may_lead():
            return averaging_pb2.JoinResponse(accepted=False, reason="not the leader")
        loop = asyncio.get_running_loop()
        previous = self._joiners.pop(member.peer_id, None)
        if previous is not None and not previous.answer.done():
            previous.answer.set_result(averaging_pb2.JoinResponse(accepted=False, reason="joined again"))
        joiner = _Joiner(member, loop.time() + max(0.0, request.timeout), loop.create_future())
        self._joiners[member.peer_id] = joiner
        self._arrived.set()
        try:
            return await asyncio.wait_for(asyncio.shield(joiner.answer), max(0.01, request.timeout))
        except TimeoutError:
            return averaging_pb2.JoinResponse(accepted=False, reason="no group formed in time")
        finally:
            if self._joiners.get(member.peer_id) is joiner:
                del self._joiners[member.peer_id]

    def _may_lead(self) -> bool:
        if self._looking is None:
            # Not averaging right now. A static group's leader is fixed, so hold the call until our
            # next step (refused then if we follow someone else); a DHT follower looks again.
            return self.peer.server is not None and isinstance(self.election, StaticElection)
        return self._leading

    async def _lead(self, me: MemberInfo, start: float, deadline: float) -> GroupInfo | None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        latest_start = start + cfg.matchmaking_share * (deadline - start)
        min_met_at: float | None = None
        next_poll = loop.time() + cfg.poll_interval
        while True:
            now = loop.time()
            live = [j for j in self._joiners.values() if not j.answer.done() and j.timeout_at > now + 0.05]
            size = 1 + len(live)
            if size >= self._start_size:
                break
            if size >= cfg.min_group_size:
                if min_met_at is None:
                    min_met_at = now
                if now >= min_met_at + cfg.join_window or now >= latest_start:
                    break
            if now >= deadline:
                return None
            if now >= next_poll and (isinstance(self.election, DHTElection) or self._down):
                next_poll = now + cfg.poll_interval
                if await self._should_step_down(me):
                    self._refuse_all("the leader changed")
                    return None
            wake = min(deadline, next_poll)
            if min_met_at is not None:
                wake = min(wake, min_met_at + cfg.join_window, latest_start)
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), max(0.001, wake - now))
            except TimeoutError:
                pass
        now = loop.time()
        live = sorted((j for j in self._joiners.values() if not j.answer.done() and j.timeout_at > now + 0.05),
                      key=lambda j: j.member.peer_id)
        chosen, rest = live[: cfg.target_group_size - 1], live[cfg.target_group_size - 1:]
        timeout = min([deadline - now] + [j.timeout_at - now for j in chosen]) - 0.05
        group = GroupInfo(
            round_id=os.urandom(16), prefix=self.prefix, members=(me, *(j.member for j in chosen)), numel=self.numel,
            timeout=max(0.01, timeout), compression=self.compression, chunk_bytes=self.chunk_bytes, schema=self.schema,
        )
        response = averaging_pb2.JoinResponse(accepted=True, group=group.to_proto())
        for j in chosen:
            j.answer.set_result(response)
        for j in rest:
            j.answer.set_result(averaging_pb2.JoinResponse(accepted=False, reason="group full"))
        return group

    async def _should_step_down(self, me: MemberInfo) -> bool:
        """Whether someone else should lead now: a DHT leader that expires earlier appeared, or a
        peer we took for down (and so led in its place) answers again."""
        if isinstance(self.election, DHTElection):
            leader = await self.election.leader(me, self._down)
            return leader is not None and leader.peer_id != me.peer_id
        for peer_id in sorted(self._down):
            candidate = getattr(self.election, "candidates", {}).get(peer_id)
            if candidate is None or peer_id > me.peer_id:
                continue
            try:
                await self.peer.pool.get(candidate.addr).info(timeout=self.config.poll_interval)
            except RPCError:
                continue
            self._down.discard(peer_id)
            return True
        return False

    def _refuse_all(self, reason: str) -> None:
        for j in list(self._joiners.values()):
            if not j.answer.done():
                j.answer.set_result(averaging_pb2.JoinResponse(accepted=False, reason=reason))
