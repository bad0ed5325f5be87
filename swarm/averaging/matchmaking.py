"""Matchmaking: how peers that want to average find a group and agree on who leads it.

A group forms around a leader. Followers call the leader's ``Join`` RPC, a long poll that is
answered with the group once it forms, so client-mode peers (which only dial out) join the same
way. The leader starts as soon as `target_group_size` members are in, or, once
`min_group_size` is met, after a short `join_window` without new arrivals (never always waiting
out a fixed window). A joiner whose call is gone (it died or gave up) is left out.

Who leads comes from an `Election` (`election`: a static list of peers, or declarations in the
DHT). `moshpit.moshpit_group_key` names the group to look for in each round of Moshpit SGD.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

from swarm.averaging.election import Candidate, DHTElection, Election, StaticElection
from swarm.averaging.group import GroupInfo, MemberInfo
from swarm.averaging.moshpit import moshpit_group_key, moshpit_next_coords, random_coords
from swarm.averaging.service import JOIN, AveragingService
from swarm.core.errors import AveragingError, ConfigError, DeadlineExceeded, PeerUnreachable, RPCError
from swarm.core.timeutil import get_dht_time
from swarm.net.server import CallContext
from swarm.proto import averaging_pb2

# The elections and Moshpit group keys live in `election` and `moshpit`; others import them from here.
__all__ = [
    "Candidate",
    "DHTElection",
    "Election",
    "Matchmaking",
    "MatchmakingConfig",
    "StaticElection",
    "moshpit_group_key",
    "moshpit_next_coords",
    "random_coords",
]

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
        min_met_at: float | None = None  # when the group last grew while at least min_group_size
        last_size = 0
        next_poll = loop.time() + cfg.poll_interval
        while True:
            now = loop.time()
            live = [j for j in self._joiners.values() if not j.answer.done() and j.timeout_at > now + 0.05]
            size = 1 + len(live)
            if size >= self._start_size:
                break
            if size >= cfg.min_group_size:
                if min_met_at is None or size > last_size:
                    # the window restarts with every arrival: followers reach the leader spread
                    # over a few round trips, so one window from the first is too short (issue #20)
                    min_met_at = now
                last_size = size
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
