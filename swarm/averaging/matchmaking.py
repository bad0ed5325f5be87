"""Matchmaking: how peers that want to average find a group and agree on who leads it.

A group forms around a leader. Followers call the leader's ``Join`` RPC, a long poll that is
answered with the group once it forms, so client-mode peers (which only dial out) join the same
way. The leader starts as soon as `target_group_size` members are in. Once `min_group_size` is
met it waits a short `join_window` for peers it knows nothing of, and for the peers the election
says are coming (declared for this group, with their announced readiness) up to a bound learned
from how late earlier joiners were (`timing`); it starts when they are in or past it. With
`adaptive=False` it waits the `join_window` only.
A joiner whose call is gone (it died or gave up) is left out. A follower whose
leader stops answering its checks (`leader_misses` in a row, every `poll_interval`) while the join
waits takes it for gone and looks for another leader. A peer that asks after its group
started is told so at once ("group started"), looks for another group of the same round, and
raises saying why when nobody else is coming. The round's timeout, which the leader writes into
the group, is a multiple of what measured rounds took, so a dead member costs that multiple.

Who leads comes from an `Election` (`election`: a static list of peers, or declarations in the
DHT). `moshpit.moshpit_group_key` names the group to look for in each round of Moshpit SGD.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from swarm.averaging.election import Candidate, DHTElection, Election, StaticElection
from swarm.averaging.group import GroupInfo, MemberInfo, cap_relayed_parts
from swarm.averaging.service import JOIN, REPORT, AveragingService
from swarm.averaging.timing import ArrivalSpread, RoundTiming
from swarm.core.errors import AveragingError, ConfigError, DeadlineExceeded, PeerUnreachable, RPCError
from swarm.core.timeutil import get_dht_time
from swarm.dht.handle import PeerHandle
from swarm.metrics import REGISTRY
from swarm.net.server import CallContext
from swarm.proto import averaging_pb2

# The elections and Moshpit group keys live in `election` and `moshpit`.
__all__ = ["Matchmaking", "MatchmakingConfig"]

logger = logging.getLogger(__name__)

_STARTED = "group started"  # how a refusal says: a group of this round formed, and you are not in it

MATCHMAKING_WAIT_BOUND = REGISTRY.gauge(
    "swarm_matchmaking_wait_bound_seconds", "How long a leader waits for a declared peer past its readiness "
    "(learned from joiners' lateness)", ("prefix",))
MATCHMAKING_WAITED = REGISTRY.gauge(
    "swarm_matchmaking_leader_waited_seconds", "How long the last group this peer led waited before it started",
    ("prefix",))
MATCHMAKING_STARTS = REGISTRY.counter(
    "swarm_matchmaking_starts_total", "Groups this peer led, by why they started", ("prefix", "why"))
MATCHMAKING_MISSED = REGISTRY.counter(
    "swarm_matchmaking_missed_total", "Times this peer learned that its round's group started without it",
    ("prefix",))
ROUND_TIMEOUT = REGISTRY.gauge(
    "swarm_averaging_round_timeout_seconds", "The timeout the last group this peer led was given", ("prefix",))


@dataclass(frozen=True)
class MatchmakingConfig:
    """How groups form.

    Attributes:
        target_group_size: the leader starts as soon as this many members are in.
        min_group_size: fewest members a round may have.
        join_window: once `min_group_size` is met, how long the leader waits after the last
            arrival for peers it knows nothing of (without `adaptive`, the only wait). Peers that
            step together reach the leader spread by their own processes' jitter between rounds
            (a new tensor, a new `Averager`: tenths of a second on a busy 2-core machine), and one
            that comes later than this after the previous arrival averages in another group or
            not at all; `swarm.Optimizer` says how many peers come (`expected_size`), so its
            leaders rarely wait this long.
        matchmaking_share: at most this share of a step's timeout goes to forming a group when
            `min_group_size` is met (the rest is for the all-reduce).
        retry_interval: pause before a follower asks again after a leader refused it.
        poll_interval: how often a waiting DHT leader checks that it still leads, and how often a
            follower whose join is pending checks that its leader still answers.
        leader_misses: checks in a row that a follower's leader leaves unanswered before the
            follower takes it for gone and looks for another leader (a host that vanished never
            answers the join, a long poll). Each waits up to `poll_interval`, and the last is
            followed by one more wait for the join's answer, so a leader that is merely slow, or
            that formed the group just then, keeps its follower.
        adaptive: wait for the peers declared for this group (up to a bound learned from how late
            joiners arrived), tell late joiners at once that the group started, and derive the
            round's timeout from measured round times. False: the fixed `join_window` and the
            step's whole remaining time as the round's timeout (the behaviour before adaptive matchmaking).
        min_wait: floor of the learned wait bound, seconds.
        max_wait: cap of the learned wait bound, and the bound before any arrival was seen: a
            declared peer that never comes costs at most this.
        round_timeout_multiple: the round's timeout is this many times its expected duration.
        min_round_timeout: floor of that timeout, seconds (the step's remaining time is its cap).
        follow_last_leader: where group keys name successive rounds (a DHT election given a key
            per step, as `swarm.Optimizer` gives each epoch), a follower whose last group formed
            goes straight to that group's leader for its next round, without declaring itself or
            reading the declarations in the DHT; the leader holds such a join for a later round
            until its own step begins (at most `max_wait`), and a follower it does not take falls
            back to the DHT at once. Every peer of a run should set it alike.
    """

    target_group_size: int = 4
    min_group_size: int = 2
    join_window: float = 1.0
    matchmaking_share: float = 0.5
    retry_interval: float = 0.05
    poll_interval: float = 0.5
    leader_misses: int = 3
    adaptive: bool = True
    min_wait: float = 0.05
    max_wait: float = 5.0
    round_timeout_multiple: float = 4.0
    min_round_timeout: float = 1.0
    follow_last_leader: bool = False

    def __post_init__(self) -> None:
        if self.min_group_size < 1 or self.target_group_size < self.min_group_size:
            raise ConfigError("need 1 <= min_group_size <= target_group_size")
        if self.join_window < 0 or not 0 < self.matchmaking_share < 1:
            raise ConfigError("need join_window >= 0 and 0 < matchmaking_share < 1")
        if self.retry_interval <= 0 or self.poll_interval <= 0:
            raise ConfigError("retry_interval and poll_interval must be > 0")
        if self.leader_misses < 1:
            raise ConfigError("leader_misses must be >= 1")
        if not 0 <= self.min_wait <= self.max_wait:
            raise ConfigError("need 0 <= min_wait <= max_wait")
        if self.round_timeout_multiple < 1 or self.min_round_timeout <= 0:
            raise ConfigError("need round_timeout_multiple >= 1 and min_round_timeout > 0")


@dataclass
class _Joiner:
    member: MemberInfo
    timeout_at: float  # loop time
    answer: asyncio.Future[averaging_pb2.JoinResponse]
    arrived: float = 0.0  # loop time
    excludes: frozenset[str] = frozenset()  # peers it will not average with (`JoinRequest.excludes`)
    key: str = ""  # the group key it asks for ("": any; a follower whose keys name no rounds)


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
        self, peer: PeerHandle, prefix: str, schema: bytes, numel: int, election: Election,
        config: MatchmakingConfig | None = None, compression: int = 0, chunk_bytes: int = 1 << 20,
    ) -> None:
        self.peer, self.prefix, self.schema, self.numel = peer, prefix, schema, numel
        self.election = election
        self.refuse: Callable[[str], str | None] | None = None  # PeerID -> why it may not join now (reputation)
        self.excluding: Callable[[], list[str]] | None = None  # peers this one excludes now, told to leaders
        self._shunned: dict[str, tuple[str, ...]] = {}  # leader -> excluded peers its last group held
        self.config = cfg = config or MatchmakingConfig()
        self.compression, self.chunk_bytes = compression, chunk_bytes
        self.spread = ArrivalSpread(initial=cfg.max_wait, floor=cfg.min_wait, cap=cfg.max_wait)
        """How late joiners arrived past their readiness: the bound a leader waits for a declared peer."""
        self.timing = RoundTiming(multiple=cfg.round_timeout_multiple, floor=cfg.min_round_timeout)
        """What this peer's rounds took: the timeout a leader writes into its group."""
        self.last_start: dict[str, Any] = {}
        """Figures behind the last group this peer led (why it started, waits, the round's timeout)."""
        self._joiners: dict[str, _Joiner] = {}
        self._arrived = asyncio.Event()
        self._looking: MemberInfo | None = None
        self._leading = False
        self._start_size = cfg.target_group_size
        self._expect_unnamed = False
        self._down: set[str] = set()
        self._vanished: set[str] = set()  # leaders this step took for gone by its own checks (`_leader_vanished`)
        self._missed: str | None = None  # why this step knows a group of its round started without it
        self._last_round: bytes | None = None  # the round this peer's last step joined (until the next step)
        self._key = ""  # the group key this step looks under, where keys name rounds (else "")
        self._last_key: str | None = None  # the key of the last group this peer's steps formed
        self._last_leader: Candidate | None = None  # that group's leader, when it was another peer
        self._led_last = False  # this peer led that group
        self._last_size = 0  # how many members it had
        self._following = False  # this step waits on another peer's Join now
        self._link = peer.pool.estimates
        self._link.exclude(JOIN, REPORT)  # long polls, not round trips
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

        With `config.adaptive`, a step that learns that its round's group started without it (the
        leader says so, or the DHT declarations do) looks for another group of the same round at
        once, and raises `AveragingError` saying so when no other peer is coming for it.
        """
        loop = asyncio.get_running_loop()
        cfg = self.config
        self._start_size = cfg.target_group_size if expected_size is None else max(
            cfg.min_group_size, min(expected_size, cfg.target_group_size))
        self._expect_unnamed = expected_size is not None or isinstance(self.election, StaticElection)
        start = loop.time()
        deadline = start + timeout
        self._down = set()
        self._vanished = set()
        self._missed = None
        names_round = isinstance(self.election, DHTElection) and self.election.names_round
        self._key = self.election.group_key if isinstance(self.election, DHTElection) and names_round else ""
        self._refuse_other_rounds()
        self._looking = me
        group: GroupInfo | None = None
        deadline_wall = get_dht_time() + timeout
        # the leader of this peer's last group, for the next round's group (`follow_last_leader`)
        straight = self._last_leader if (cfg.follow_last_leader and self._key and self._last_key is not None
                                         and self._last_key != self._key) else None
        declared = False
        try:
            waited_from: float | None = None  # since when this step waited for straight members
            if straight is None and self._leads_again(expected_size):
                waited_from = loop.time()
                group = await self._lead_again(me, deadline)
                if group is not None:
                    return group
            if straight is None:
                declared = True
                await self.election.begin(me, deadline_wall)
            while loop.time() < deadline:
                if straight is not None:
                    group = await self._follow_leader(me, straight, deadline, straight=True)
                    if group is not None:
                        return group
                    # not taken (it leads no group of this round, or not yet): ask the DHT as usual
                    logger.debug("last leader %s did not take this peer for round %s: declaring in the DHT",
                                 straight.peer_id[-8:], self._key)
                    straight = None
                    declared = True
                    await self.election.begin(me, deadline_wall)
                    continue
                candidate = await self.election.leader(me, self._down)
                if cfg.adaptive and self._missed is None and isinstance(self.election, DHTElection) \
                        and self.election.started:
                    rounds = sorted(set(self.election.started.values()))
                    self._missed = f"round(s) {', '.join(r[:8] for r in rounds)} of this group started without this peer"
                if candidate is None:
                    await asyncio.sleep(self.config.retry_interval)
                    continue
                if candidate.peer_id == me.peer_id:
                    self._leading = True
                    try:
                        group = await self._lead(me, start, deadline, waited_from)
                    finally:
                        self._leading = False
                    if group is not None:
                        return group
                    continue
                # we follow someone else: whoever asked us to lead must look again
                self._refuse_all("not the leader")
                group = await self._follow_leader(me, candidate, deadline)
                if group is not None:
                    return group
            if self._missed is not None:
                raise AveragingError(f"no averaging group formed within {timeout:.1f} s: {self._missed}")
            raise AveragingError(f"no averaging group formed within {timeout:.1f} s")
        finally:
            self._end_of_step(me, group)
            self._looking = None
            if group is None and declared:
                await self.election.end(me, None)
            if group is not None and declared:
                # Withdrawing the declaration is a DHT store: seconds at WAN latencies, and more on
                # one member than another. Each member counts the round's timeout from when it holds
                # the group, so waiting for it here started some members seconds after the others,
                # past a short learned timeout (whole groups failing on "reducer(s) ... did
                # not report" with nobody crashed). `DHTElection.end` runs the store in the
                # background and returns at once; the next `begin` waits for it.
                await self.election.end(me, group.round_id)

    def _refused(self, peer_id: str) -> str | None:
        """Why this peer does not average with `peer_id` now (reputation), or None. A leader whose
        last group held a peer excluded here is avoided while that peer stays excluded."""
        if self.refuse is None:
            return None
        refusal = self.refuse(peer_id)
        if refusal is None and any(self.refuse(x) is not None for x in self._shunned.get(peer_id, ())):
            refusal = "its last group held a peer this peer excludes"
        return refusal

    async def _follow_leader(self, me: MemberInfo, leader: Candidate, deadline: float,
                             straight: bool = False) -> GroupInfo | None:
        self._following = True
        try:
            return await self._follow(me, leader, deadline, straight)
        finally:
            self._following = False

    async def _follow(self, me: MemberInfo, leader: Candidate, deadline: float,
                      straight: bool = False) -> GroupInfo | None:
        """Joins `leader`'s group. `straight`: it led this peer's last group, and no declaration
        named it for this round: a refusal then only means "not here" (it led none of this
        round yet, follows another, or is of a version that keeps no keys, whose "group started"
        names its last round), and the step asks the DHT at once, holding nothing against it;
        only a "group started" that names this round's key says this peer missed it."""
        loop = asyncio.get_running_loop()
        refusal = self._refused(leader.peer_id)
        if refusal is not None:  # local reputation: this peer does not average with it, led or not
            logger.debug("not joining %s: %s", leader.peer_id[-8:], refusal)
            self._down.add(leader.peer_id)
            return None
        remaining = deadline - loop.time()
        request = averaging_pb2.JoinRequest(
            prefix=self.prefix, group_key=self._key, schema=self.schema, numel=self.numel, member=me.to_proto(),
            timeout=remaining, excludes=self.excluding() if self.excluding is not None else (),
        )
        channel = self.peer.pool.get(leader.addr)
        join = asyncio.ensure_future(channel.unary(JOIN, request, averaging_pb2.JoinResponse, timeout=max(0.01, remaining)))
        try:
            vanished = await self._leader_vanished(leader, channel, join)
        finally:
            if not join.done():
                join.cancel()
                await asyncio.gather(join, return_exceptions=True)
        if vanished:
            logger.debug("leader %s left %d check(s) in a row unanswered: taking it for gone",
                         leader.peer_id[-8:], self.config.leader_misses)
            self._down.add(leader.peer_id)
            self._vanished.add(leader.peer_id)
            return None
        try:
            response = join.result()
        except PeerUnreachable as e:
            logger.debug("leader %s is down: %s", leader.peer_id[-8:], e)
            self._down.add(leader.peer_id)
            return None
        except RPCError as e:  # slow or refusing, not gone: ask again rather than lead without it
            logger.debug("join at %s failed: %s", leader.peer_id[-8:], e)
            if straight or (isinstance(e, DeadlineExceeded) and loop.time() >= deadline - 0.05):
                return None
            await asyncio.sleep(self.config.retry_interval * (1 + random.random()))
            return None
        if response.accepted:
            group = GroupInfo.from_proto(response.group)
            if group.prefix != self.prefix or me.peer_id not in group.peer_ids or group.leader.peer_id != leader.peer_id:
                logger.warning("leader %s sent a group that does not match the request", leader.peer_id[-8:])
                self._down.add(leader.peer_id)
                return None
            excluded = [m.peer_id for m in group.members if self._refused(m.peer_id) is not None]
            if excluded:
                # the leader let in a peer this one excludes: leave, and avoid that leader while the
                # peer stays excluded (the group's round fails without this member's part this once)
                logger.info("leaving the group of %s: it holds %s, excluded by this peer's reputation",
                            leader.peer_id[-8:], ", ".join(pid[-8:] for pid in excluded))
                self._shunned[leader.peer_id] = tuple(excluded)
                self._down.add(leader.peer_id)
                return None
            return group
        logger.debug("leader %s refused: %s", leader.peer_id[-8:], response.reason)
        if "schema" in response.reason:
            raise AveragingError(f"leader {leader.peer_id} averages other tensors: {response.reason}")
        if straight and not (self._key and response.reason.startswith(_STARTED)
                             and response.started_group_key == self._key):
            return None
        if response.reason.startswith(_STARTED) and self.config.adaptive:
            # it is in a group of this round already: look for the next one now, not after a pause
            self._down.add(leader.peer_id)
            self._missed = f"the group of {leader.peer_id[-8:]} started without this peer ({response.reason})"
            MATCHMAKING_MISSED.labels(self.prefix).inc()
            return None
        if response.reason == "not the leader":
            # our view of who is down may be what sent us there: look again, but keep the leaders
            # this step saw vanish itself. The next leader is often still waiting on the same
            # vanished leader (it notices later); asking it again soon makes one group of them
            # (followers going back to the vanished leader came too late and scattered).
            self._down = set(self._vanished)
        await asyncio.sleep(self.config.retry_interval * (1 + random.random()))
        return None

    async def _leader_vanished(self, leader: Candidate, channel: Any, join: asyncio.Future[Any]) -> bool:
        """Waits for the join's answer; True if the leader stopped answering first.

        Every `poll_interval` the follower asks the leader's Info over the channel the join
        uses. A refused connection means nobody listens there any more; otherwise the leader
        counts as gone after `leader_misses` unanswered checks in a row and one more check's
        wait for the join itself (an answer sent as the last check failed still arrives). A
        check whose deadline fired late (this process was starved: an overloaded machine starves
        the leader too) does not count.
        """
        cfg = self.config
        loop = asyncio.get_running_loop()
        misses = 0
        while True:
            done, _ = await asyncio.wait({join}, timeout=cfg.poll_interval)
            if done:
                return False
            timeout = self._link.deadline(leader.peer_id, 0, multiple=4, floor=cfg.poll_interval / 2,
                                          cap=cfg.poll_interval)
            sent = loop.time()
            probe = asyncio.ensure_future(channel.info(timeout=timeout))
            done, _ = await asyncio.wait({join, probe}, return_when=asyncio.FIRST_COMPLETED)
            if join in done:
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
                return False
            error = probe.exception()
            if error is None:
                misses = 0
                continue
            if isinstance(error, PeerUnreachable):
                return True
            if not isinstance(error, RPCError | TimeoutError):
                raise error
            if loop.time() - sent > 2 * timeout:
                continue  # this process was starved itself (its timer fired late): the check says nothing
            misses += 1
            if misses >= cfg.leader_misses:
                done, _ = await asyncio.wait({join}, timeout=timeout)
                return not done

    # -- leader side -------------------------------------------------------------------------

    async def rpc_join(self, request: averaging_pb2.JoinRequest, ctx: CallContext) -> averaging_pb2.JoinResponse:
        """A follower asks to be in this peer's next group (answered when the group forms)."""
        if request.schema != self.schema or request.numel != self.numel:
            return averaging_pb2.JoinResponse(accepted=False, reason="schema mismatch: different tensors or aggregation settings")
        try:
            member = MemberInfo.from_proto(request.member)
        except ConfigError as e:
            return averaging_pb2.JoinResponse(accepted=False, reason=f"bad member: {e}")
        if member.peer_id != ctx.peer_id:
            return averaging_pb2.JoinResponse(accepted=False, reason="a peer may only join as itself")
        refusal = self._refused(member.peer_id)
        if refusal is not None:  # local reputation (`reputation`): this peer keeps it out a while
            return averaging_pb2.JoinResponse(accepted=False, reason=refusal)
        if self.peer.peer_id in request.excludes:
            return averaging_pb2.JoinResponse(accepted=False, reason="the follower excludes this leader")
        key = request.group_key
        missed = (averaging_pb2.JoinResponse(accepted=False, reason=f"{_STARTED}: this peer is in round "
                                             f"{self._last_round.hex()[:8]}", started_group_key=self._last_key or "")
                  if self._last_round is not None and self.config.adaptive else None)
        if self._looking is not None and self._key and key and key != self._key:
            # a group of another round: never mix rounds in one group
            if key == self._last_key and missed is not None:
                return missed
            return averaging_pb2.JoinResponse(accepted=False, reason=f"this peer looks for the group of {self._key!r}")
        hold = self._holds(key)
        if not hold and not self._may_lead():
            if self._looking is None and missed is not None:
                return missed
            return averaging_pb2.JoinResponse(accepted=False, reason="not the leader")
        loop = asyncio.get_running_loop()
        previous = self._joiners.pop(member.peer_id, None)
        if previous is not None and not previous.answer.done():
            previous.answer.set_result(averaging_pb2.JoinResponse(accepted=False, reason="joined again"))
        joiner = _Joiner(member, loop.time() + max(0.0, request.timeout), loop.create_future(), loop.time(),
                         frozenset(request.excludes), key)
        self._joiners[member.peer_id] = joiner
        self._arrived.set()
        try:
            if hold and self._looking is None:
                # held for this peer's next step: at most `max_wait`, so a leader that stopped
                # stepping does not keep its last group's members from the DHT for long
                try:
                    return await asyncio.wait_for(asyncio.shield(joiner.answer), min(request.timeout, self.config.max_wait))
                except TimeoutError:
                    if self._looking is None or self._key != key:
                        return self._answer(joiner, "not leading a group of that round yet")
            left = joiner.timeout_at - loop.time()
            return await asyncio.wait_for(asyncio.shield(joiner.answer), max(0.01, left))
        except TimeoutError:
            return self._answer(joiner, "no group formed in time")
        finally:
            if self._joiners.get(member.peer_id) is joiner:
                del self._joiners[member.peer_id]

    @staticmethod
    def _answer(joiner: _Joiner, refusal: str) -> averaging_pb2.JoinResponse:
        """The joiner's answer: the one it was given, else this refusal (given here, once, so a
        group that formed just now keeps its answer)."""
        if not joiner.answer.done():
            joiner.answer.set_result(averaging_pb2.JoinResponse(accepted=False, reason=refusal))
        return joiner.answer.result()

    def _holds(self, key: str) -> bool:
        """Whether a join for group `key` waits here although this peer does not lead a group now
        (`follow_last_leader`): this peer led the last group it was in, and a member of it asks for
        the next round's group before this peer's step for it began (held until it begins) or while
        that step still reads who leads (answered when it knows)."""
        return (self.config.follow_last_leader and bool(key) and self._led_last and key != self._last_key
                and self.peer.server is not None and not self._following
                and (self._looking is None or key == self._key))

    def _end_of_step(self, me: MemberInfo, group: GroupInfo | None) -> None:
        """Records the step's group for the next step's matchmaking and answers the joins still
        waiting for this step's group: it formed without them, or none formed here."""
        if group is None:
            self._last_round, self._last_leader, self._led_last = None, None, False  # the next try asks the DHT
        else:
            self._last_round, self._last_key, self._last_size = group.round_id, self._key, len(group.members)
            leader = group.leader
            self._led_last = leader.peer_id == me.peer_id
            self._last_leader = None if self._led_last else Candidate(leader.peer_id, leader.addr)
        if group is None or not self.config.adaptive:
            refusal = averaging_pb2.JoinResponse(accepted=False, reason="not the leader")
        else:
            refusal = averaging_pb2.JoinResponse(accepted=False, reason=f"{_STARTED}: this peer is in round "
                                                 f"{group.round_id.hex()[:8]}", started_group_key=self._key or "")
        for j in list(self._joiners.values()):
            if not j.answer.done() and (not j.key or j.key == self._key):
                j.answer.set_result(refusal)

    def _refuse_other_rounds(self) -> None:
        """At a step's start: joins held for another round than this step's are refused, so their
        followers look in the DHT at once."""
        for j in list(self._joiners.values()):
            if j.key and j.key != self._key and not j.answer.done():
                j.answer.set_result(averaging_pb2.JoinResponse(
                    accepted=False, reason=f"this peer looks for the group of {self._key!r}"))

    def _may_lead(self) -> bool:
        if self._looking is None:
            # Not averaging right now. A static group's leader is fixed, so hold the call until our
            # next step (refused then if we follow someone else); a DHT follower looks again.
            return self.peer.server is not None and isinstance(self.election, StaticElection)
        return self._leading

    def _live(self, now: float) -> list[_Joiner]:
        return [j for j in self._joiners.values() if not j.answer.done() and j.timeout_at > now + 0.05]

    def _keep_apart(self, joiners: list[_Joiner]) -> tuple[list[_Joiner], dict[str, list[str]]]:
        """Splits `joiners` into those that may share this leader's group and those kept out of it
        (PeerID -> the peers it conflicts with): no member is grouped with a peer that excludes it
        or that it excludes (`JoinRequest.excludes`, local reputation), nor with one this leader
        excludes now. Of conflicting joiners the one in the most conflicts goes first, the latest
        arrival on ties, so the side more members agree on stays (docs/architecture.md,
        "Robust averaging")."""
        kept = [j for j in joiners if self._refused(j.member.peer_id) is None]
        apart = {j.member.peer_id: [self.peer.peer_id] for j in joiners if j not in kept}
        if not any(j.excludes for j in kept):
            return kept, apart
        while True:
            present = {j.member.peer_id: j for j in kept}
            rivals = {pid: [o for o, k in present.items() if o != pid and (o in j.excludes or pid in k.excludes)]
                      for pid, j in present.items()}
            worst = max(kept, key=lambda j: (len(rivals[j.member.peer_id]), j.arrived), default=None)
            if worst is None or not rivals[worst.member.peer_id]:
                return kept, apart
            kept.remove(worst)
            apart[worst.member.peer_id] = rivals[worst.member.peer_id]

    def _outstanding(self, me: MemberInfo, now: float, expected_at: dict[str, float], bound: float) -> dict[str, float]:
        """Declared peers not in yet -> loop time until which this leader waits for them.

        A peer is expected at its announced readiness or, if that passed, when this leader first
        saw its declaration; it is waited for `bound` seconds past that.
        """
        wall = get_dht_time()
        out: dict[str, float] = {}
        for peer_id, declaration in self.election.declared(me).items():
            if peer_id in self._down:
                continue
            if peer_id not in expected_at:
                expected_at[peer_id] = max(now, now + declaration.ready_at - wall)
            joiner = self._joiners.get(peer_id)
            if joiner is not None and not joiner.answer.done():
                continue
            until = expected_at[peer_id] + bound
            if until > now:
                out[peer_id] = until
        if self._expect_unnamed and 1 + len(self.election.declared(me)) < self._start_size:
            # more peers are expected than declared (client-mode members of a static group are not
            # listed; training progress names peers that have not declared yet): wait for them too
            until = expected_at.setdefault("", now) + bound
            if until > now:
                out[""] = until
        return out

    def _leads_again(self, expected_size: int | None) -> bool:
        """Whether this step may lead its last group's members again without the DHT
        (`follow_last_leader`): this peer led that group, keys name rounds, and the peers expected
        (training progress says how many) are no more than that group held, so every one of them
        can come straight here (a newcomer, which only the DHT can lead here, makes it declare)."""
        return (self.config.follow_last_leader and bool(self._key) and self._led_last
                and self._last_key is not None and self._last_key != self._key and self.peer.server is not None
                and expected_size is not None and expected_size <= min(self._last_size, self.config.target_group_size))

    async def _lead_again(self, me: MemberInfo, deadline: float) -> GroupInfo | None:
        """Leads the group of this round with the joins held for it (`_holds`: the last group's
        members come straight here), starting once every expected peer is in, before declaring
        anything: no store, read or withdrawal in the DHT. Waits a couple of round trips at most
        (its learned bound, if shorter); returns None if they did not all come by then (the step
        then declares and leads or follows as usual, the joins still held, and the wait for
        peers not declared counts from here: a member that died costs one bound). It teaches the
        bound nothing: a member's lateness is past its announced readiness, which is in the DHT,
        unread here (the steps that declare go on teaching it)."""
        loop = asyncio.get_running_loop()
        led_at = loop.time()
        rtt = self._link.rtt()
        bound = self.spread.bound(rtt)
        # members that stepped when this peer did are in within a couple of round trips; a later
        # one is waited for declared, as before, where its announcement says when it comes
        until = min(deadline, led_at + min(bound, self.config.min_wait + 2 * (rtt or 0.0)))
        self._leading = True
        try:
            while True:
                now = loop.time()
                if 1 + len(self._keep_apart(self._live(now))[0]) >= self._start_size:
                    return self._start(me, now, deadline, led_at, "every expected peer came straight", bound, {})
                if now >= until:
                    logger.debug("round %s: not every expected peer came straight within %.3f s; declaring",
                                 self._key, until - led_at)
                    return None
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), until - now)
                except TimeoutError:
                    pass
        finally:
            self._leading = False

    async def _lead(self, me: MemberInfo, start: float, deadline: float,
                    waited_from: float | None = None) -> GroupInfo | None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        latest_start = start + cfg.matchmaking_share * (deadline - start)
        led_at = loop.time()
        min_met_at: float | None = None  # when the group last grew while at least min_group_size
        last_size = 0
        next_poll = led_at + cfg.poll_interval
        refreshed_at = led_at  # `election.leader` just looked at the declarations
        # peers expected without a declaration are waited for from when `_lead_again` began waiting
        expected_at: dict[str, float] = {"": waited_from} if waited_from is not None else {}
        rtt = self._link.rtt()
        bound = self.spread.bound(rtt) + self.election.patience()
        # A peer that missed its round's group waits for another group of that round only while a
        # declared peer may still come (`outstanding`, up to `bound` each) and for its slowest
        # declaration exchange and a few round trips for a peer that declared just as it did:
        # the peers whose rounds all started without it are done, and waiting `bound` for peers
        # nobody declared kept it out of phase with its next round.
        missed_wait = min(bound, max(cfg.min_wait, self.election.read_seconds) + 4 * (rtt or 0.05))
        outstanding: dict[str, float] = {}
        why = ""
        while True:
            now = loop.time()
            # a follower reads the same declarations: the window covers the slowest read this peer
            # saw (a crashed replica holds each read for the DHT's request timeout)
            window = max(cfg.join_window, self.election.read_seconds)
            size = 1 + len(self._keep_apart(self._live(now))[0])
            if cfg.adaptive:
                outstanding = self._outstanding(me, now, expected_at, bound)
            if size >= self._start_size:
                why = "target size" if self._start_size == cfg.target_group_size else "expected size"
                break
            if size >= cfg.min_group_size:
                if min_met_at is None or size > last_size:
                    # the window restarts with every arrival: followers reach the leader spread
                    # over a few round trips, so one window from the first is too short
                    min_met_at = now
                last_size = size
                if now >= latest_start:
                    why = "matchmaking share of the timeout spent"
                    break
                if not cfg.adaptive and now >= min_met_at + window:
                    why = "join window"
                    break
                if cfg.adaptive and not outstanding and now >= min_met_at + window:
                    if refreshed_at < min_met_at + window:  # a peer may have declared meanwhile
                        await self.election.refresh(me)
                        refreshed_at = loop.time()
                        continue
                    why = "every declared peer is in or past its wait bound"
                    break
            elif cfg.adaptive and self._missed is not None and not outstanding and now >= led_at + missed_wait:
                if refreshed_at < led_at + missed_wait:  # look once more before giving up
                    await self.election.refresh(me)
                    refreshed_at = loop.time()
                    continue
                raise AveragingError(f"{self._missed}, and no other peer is coming for another group of it "
                                     f"(waited {now - led_at:.2f} s; no declared peer is still looking)")
            if now >= deadline:
                return None
            if now >= next_poll and (isinstance(self.election, DHTElection) or self._down):
                next_poll = now + cfg.poll_interval
                refreshed_at = now
                if await self._should_step_down(me):
                    self._refuse_all("the leader changed")
                    return None
            wake = min(deadline, next_poll)
            if outstanding:
                wake = min(wake, *outstanding.values())
            elif self._missed is not None and now < led_at + missed_wait:
                wake = min(wake, led_at + missed_wait)
            if min_met_at is not None:
                wake = min(wake, latest_start)
                if now < min_met_at + window:
                    wake = min(wake, min_met_at + window)
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), max(0.001, wake - now))
            except TimeoutError:
                pass
        return self._start(me, loop.time(), deadline, led_at, why, bound, outstanding, expected_at)

    def _start(self, me: MemberInfo, now: float, deadline: float, led_at: float, why: str, bound: float,
               outstanding: dict[str, float], expected_at: dict[str, float] | None = None) -> GroupInfo:
        """Forms the group of the joins in now (up to the target size) and answers every joiner;
        the lateness of members that were expected (`expected_at`) teaches the wait bound."""
        cfg = self.config
        kept, apart = self._keep_apart(self._live(now))
        live = sorted(kept, key=lambda j: j.member.peer_id)
        chosen, rest = live[: cfg.target_group_size - 1], live[cfg.target_group_size - 1:]
        cap = min([deadline - now] + [j.timeout_at - now for j in chosen]) - 0.05
        timeout = self._round_timeout(cap, 1 + len(chosen)) if cfg.adaptive else cap
        for j in chosen:
            if expected_at is not None and j.member.peer_id in expected_at:
                self.spread.observe(j.arrived - expected_at[j.member.peer_id])
        group = GroupInfo(
            round_id=os.urandom(16), prefix=self.prefix, members=cap_relayed_parts((me, *(j.member for j in chosen))),
            numel=self.numel,
            timeout=max(0.01, timeout), compression=self.compression, chunk_bytes=self.chunk_bytes, schema=self.schema,
        )
        self._report_start(group, why, now - led_at, bound, outstanding, cap)
        response = averaging_pb2.JoinResponse(accepted=True, group=group.to_proto())
        for j in chosen:
            j.answer.set_result(response)
        full = f"{_STARTED}: round {group.round_id.hex()[:8]} is full"
        for j in rest:
            j.answer.set_result(averaging_pb2.JoinResponse(accepted=False, reason=full if cfg.adaptive else "group full"))
        for j in self._live(now):
            if j.member.peer_id in apart:
                who = ", ".join(pid[-8:] for pid in apart[j.member.peer_id])
                apart_why = f"kept apart from {who} (one of each pair excludes the other)"
                j.answer.set_result(averaging_pb2.JoinResponse(accepted=False, reason=(
                    f"{_STARTED}: round {group.round_id.hex()[:8]} {apart_why}" if cfg.adaptive else apart_why)))
        return group

    def _round_timeout(self, cap: float, size: int) -> float:
        """The round's timeout: a multiple of what rounds took (or of what the links' throughput
        says the bytes take), within [min_round_timeout, cap]."""
        estimate = None
        if size > 1:
            # butterfly: each link carries one part (1/n of the vector, raw float32 at most) each
            # way, all links at once; the measured throughput is per link (`allreduce`)
            estimate = self._link.expected_time(None, int(2 * self.numel * 4 / size))
        return self.timing.timeout(cap, estimate)

    def _report_start(self, group: GroupInfo, why: str, waited: float, bound: float,
                      outstanding: dict[str, float], cap: float) -> None:
        expected = self.timing.expected()
        rtt = self._link.rtt()
        self.last_start = {
            "why": why, "size": len(group.members), "waited": waited, "wait_bound": bound,
            "lags_seen": len(self.spread.lags), "left_waiting_for": sorted(outstanding),
            "round_timeout": group.timeout, "timeout_cap": cap, "expected_round": expected,
            "backoff": self.timing.backoff, "rtt": rtt,
        }
        MATCHMAKING_WAIT_BOUND.labels(self.prefix).set(bound)
        MATCHMAKING_WAITED.labels(self.prefix).set(waited)
        ROUND_TIMEOUT.labels(self.prefix).set(group.timeout)
        MATCHMAKING_STARTS.labels(self.prefix, why).inc()
        logger.debug(
            "leading round %s of %s: started with %d member(s) after %.3f s (%s); wait bound %.3f s from %d lag(s); "
            "round timeout %.2f s (expected round %s s x %.0f x backoff %.0f, cap %.2f s); RTT %s s",
            group.round_id.hex()[:8], self.prefix, len(group.members), waited, why, bound, len(self.spread.lags),
            group.timeout, f"{expected:.3f}" if expected is not None else "unknown", self.timing.multiple,
            self.timing.backoff, cap, f"{rtt:.4f}" if rtt is not None else "unknown")

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
            timeout = self._link.deadline(peer_id, 0, multiple=4, floor=0.05, cap=self.config.poll_interval)
            try:
                await self.peer.pool.get(candidate.addr).info(timeout=timeout)
            except RPCError:
                continue
            self._down.discard(peer_id)
            return True
        return False

    def _refuse_all(self, reason: str) -> None:
        for j in list(self._joiners.values()):
            if not j.answer.done():
                j.answer.set_result(averaging_pb2.JoinResponse(accepted=False, reason=reason))
