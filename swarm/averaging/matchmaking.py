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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from swarm.averaging.election import Candidate, Election
from swarm.averaging.group import GroupInfo, MemberInfo, cap_relayed_parts
from swarm.averaging.service import JOIN, REPORT, AveragingService
from swarm.averaging.timing import ArrivalSpread, RoundTiming
from swarm.core.errors import AveragingError, ConfigError, DeadlineExceeded, PeerUnreachable, RPCError
from swarm.core.timeutil import get_dht_time
from swarm.dht.handle import PeerHandle
from swarm.metrics import REGISTRY
from swarm.net.channels import PeerChannel
from swarm.net.server import CallContext
from swarm.proto import averaging_pb2, peer_pb2

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
            leaders rarely wait this long. The wait is longer where the leader's own reads were
            slower, or while its DHT knows dead nodes (one request timeout: a follower's read
            may still wait on them).
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


_LOOK_AGAIN = "look again"  # `_why_start`: read the declarations once more before deciding


@dataclass
class _Lead:
    """The state of one wait of a leader for its group to fill (`Matchmaking._lead`)."""

    led_at: float  # loop time it began leading
    latest_start: float  # it starts by then once `min_group_size` is met (the matchmaking share)
    deadline: float  # the step's
    bound: float  # how long past its readiness a declared peer is waited for
    missed_wait: float  # how long a step that missed its round's group waits for another one
    expected_at: dict[str, float]  # declared peer -> loop time it was expected from ("": peers not declared)
    outstanding: dict[str, float] = field(default_factory=dict)  # declared peers not in -> waited for until
    min_met_at: float | None = None  # when the group last grew while at least `min_group_size`
    last_size: int = 0
    next_poll: float = 0.0  # when it checks next that it still leads
    refreshed_at: float = 0.0  # when it last looked at the declarations

    def wake(self, now: float, window: float, missed: bool) -> float:
        """Seconds until something may change what the leader decides (an arrival comes sooner)."""
        wake = min(self.deadline, self.next_poll)
        if self.outstanding:
            wake = min(wake, *self.outstanding.values())
        elif missed and now < self.led_at + self.missed_wait:
            wake = min(wake, self.led_at + self.missed_wait)
        if self.min_met_at is not None:
            wake = min(wake, self.latest_start)
            if now < self.min_met_at + window:
                wake = min(wake, self.min_met_at + window)
        return wake - now


@dataclass
class _Step:
    """One `form_group` call's state, alive as long as the call (the `Join` handler reads it)."""

    me: MemberInfo
    key: str  # the group key this step looks under, where keys name rounds (else "")
    start_size: int  # a leader starts once this many are in
    expect_unnamed: bool  # more peers may come than the election names (progress counts them, or a static list)
    down: set[str] = field(default_factory=set)  # peers this step does not follow now
    vanished: set[str] = field(default_factory=set)  # leaders this step took for gone by its own checks
    missed: str | None = None  # why this step knows a group of its round started without it
    leading: bool = False  # this step leads a group now
    following: bool = False  # this step waits on another peer's Join now


class RoundStart(TypedDict, total=False):
    """Figures behind the last group a peer led (`Matchmaking.last_start`; empty before its first)."""

    why: str                     # what let the round start
    size: int                    # members of the group
    waited: float                # seconds the leader waited for joiners
    wait_bound: float            # how long it would have waited at most
    lags_seen: int               # late arrivals in the spread behind that bound
    left_waiting_for: list[str]  # declared peers that had not come when it started
    round_timeout: float         # the timeout written into the group
    timeout_cap: float
    expected_round: float | None
    backoff: float
    rtt: float | None


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
        self.last_start: RoundStart = {}
        """Figures behind the last group this peer led (why it started, waits, the round's timeout)."""
        self._joiners: dict[str, _Joiner] = {}
        self._arrived = asyncio.Event()
        self._step: _Step | None = None  # the step looking for a group now
        self._last_round: bytes | None = None  # the round this peer's last step joined (until the next step)
        self._last_key: str | None = None  # the key of the last group this peer's steps formed
        self._last_leader: Candidate | None = None  # that group's leader, when it was another peer
        self._led_last = False  # this peer led that group
        self._last_size = 0  # how many members it had
        # the rounds (hex ids) of this peer's recent groups. A round that failed is retried under
        # the same key, and its members' declarations still name it until they declare again: a
        # round this peer was in never started without it
        self._joined_rounds: deque[str] = deque(maxlen=16)
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
        start = loop.time()
        deadline = start + timeout
        step = _Step(
            me, key=self.election.round_key,
            start_size=cfg.target_group_size if expected_size is None else max(
                cfg.min_group_size, min(expected_size, cfg.target_group_size)),
            expect_unnamed=expected_size is not None or self.election.fixed)
        self._refuse_other_rounds(step.key)
        self._step = step
        group: GroupInfo | None = None
        deadline_wall = get_dht_time() + timeout
        # the leader of this peer's last group, for the next round's group (`follow_last_leader`)
        straight = self._last_leader if (cfg.follow_last_leader and step.key and self._last_key is not None
                                         and self._last_key != step.key) else None
        declared = False
        try:
            waited_from: float | None = None  # since when this step waited for straight members
            if straight is None and self._leads_again(step, expected_size):
                waited_from = loop.time()
                group = await self._lead_again(step, deadline)
                if group is not None:
                    return group
            if straight is not None:
                group = await self._follow_leader(step, straight, deadline, straight=True)
                if group is not None:
                    return group
                # not taken (it leads no group of this round, or not yet): ask the DHT as usual
                logger.debug("last leader %s did not take this peer for round %s: declaring in the DHT",
                             straight.peer_id[-8:], step.key)
            declared = True
            await self.election.begin(me, deadline_wall)
            group = await self._elect_and_join(step, start, deadline, waited_from)
            return group
        finally:
            self._end_of_step(step, group)
            self._step = None
            await self._withdraw(me, group, declared)

    async def _elect_and_join(self, step: _Step, start: float, deadline: float, waited_from: float | None) -> GroupInfo:
        """Asks the election who leads until a group forms: leads it, or joins the leader's."""
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            candidate = await self.election.leader(step.me, step.down)
            rounds = sorted(set(self.election.started.values()).difference(self._joined_rounds))
            if self.config.adaptive and step.missed is None and rounds:
                step.missed = f"round(s) {', '.join(r[:8] for r in rounds)} of this group started without this peer"
            if candidate is None:
                await asyncio.sleep(self.config.retry_interval)
                continue
            if candidate.peer_id == step.me.peer_id:
                step.leading = True
                try:
                    group = await self._lead(step, start, deadline, waited_from)
                finally:
                    step.leading = False
            else:
                # we follow someone else: whoever asked us to lead must look again
                self._refuse_all("not the leader")
                group = await self._follow_leader(step, candidate, deadline)
            if group is not None:
                return group
        timeout = deadline - start
        if step.missed is not None:
            raise AveragingError(f"no averaging group formed within {timeout:.1f} s: {step.missed}")
        raise AveragingError(f"no averaging group formed within {timeout:.1f} s")

    async def _withdraw(self, me: MemberInfo, group: GroupInfo | None, declared: bool) -> None:
        """Ends a step's declaration (if it declared), naming its round where it found a group."""
        if not declared:
            return
        # Withdrawing the declaration is a DHT store: seconds at WAN latencies, and more on one
        # member than another. Each member counts the round's timeout from when it holds the group,
        # so waiting for it here started some members seconds after the others, past a short learned
        # timeout (whole groups failing on "reducer(s) ... did not report" with nobody crashed).
        # `DHTElection.end` runs the store in the background and returns at once; the next `begin`
        # waits for it.
        await self.election.end(me, None if group is None else group.round_id)

    def _refused(self, peer_id: str) -> str | None:
        """Why this peer does not average with `peer_id` now (reputation), or None. A leader whose
        last group held a peer excluded here is avoided while that peer stays excluded."""
        if self.refuse is None:
            return None
        refusal = self.refuse(peer_id)
        if refusal is None and any(self.refuse(x) is not None for x in self._shunned.get(peer_id, ())):
            refusal = "its last group held a peer this peer excludes"
        return refusal

    async def _follow_leader(self, step: _Step, leader: Candidate, deadline: float,
                             straight: bool = False) -> GroupInfo | None:
        step.following = True
        try:
            return await self._follow(step, leader, deadline, straight)
        finally:
            step.following = False

    async def _follow(self, step: _Step, leader: Candidate, deadline: float, straight: bool = False) -> GroupInfo | None:
        """Joins `leader`'s group. `straight`: it led this peer's last group, and no declaration
        named it for this round: a refusal then only means "not here" (it led none of this
        round yet, follows another, or is of a version that keeps no keys, whose "group started"
        names its last round), and the step asks the DHT at once, holding nothing against it;
        only a "group started" that names this round's key says this peer missed it."""
        loop = asyncio.get_running_loop()
        refusal = self._refused(leader.peer_id)
        if refusal is not None:  # local reputation: this peer does not average with it, led or not
            logger.debug("not joining %s: %s", leader.peer_id[-8:], refusal)
            step.down.add(leader.peer_id)
            return None
        remaining = deadline - loop.time()
        request = averaging_pb2.JoinRequest(
            prefix=self.prefix, group_key=step.key, schema=self.schema, numel=self.numel, member=step.me.to_proto(),
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
            step.down.add(leader.peer_id)
            step.vanished.add(leader.peer_id)
            return None
        try:
            response = join.result()
        except PeerUnreachable as e:
            logger.debug("leader %s is down: %s", leader.peer_id[-8:], e)
            step.down.add(leader.peer_id)
            return None
        except RPCError as e:  # slow or refusing, not gone: ask again rather than lead without it
            logger.debug("join at %s failed: %s", leader.peer_id[-8:], e)
            if straight or (isinstance(e, DeadlineExceeded) and loop.time() >= deadline - 0.05):
                return None
            await asyncio.sleep(self.config.retry_interval * (1 + random.random()))
            return None
        if response.accepted:
            return self._accepted(step, leader, response)
        await self._refused_by(step, leader, response, straight)
        return None

    def _accepted(self, step: _Step, leader: Candidate, response: averaging_pb2.JoinResponse) -> GroupInfo | None:
        """The group `leader` answered with, or None if this peer does not take it."""
        group = GroupInfo.from_proto(response.group)
        if group.prefix != self.prefix or step.me.peer_id not in group.peer_ids or group.leader.peer_id != leader.peer_id:
            logger.warning("leader %s sent a group that does not match the request", leader.peer_id[-8:])
            step.down.add(leader.peer_id)
            return None
        excluded = [m.peer_id for m in group.members if self._refused(m.peer_id) is not None]
        if excluded:
            # the leader let in a peer this one excludes: leave, and avoid that leader while the
            # peer stays excluded (the group's round fails without this member's part this once)
            logger.info("leaving the group of %s: it holds %s, excluded by this peer's reputation",
                        leader.peer_id[-8:], ", ".join(pid[-8:] for pid in excluded))
            self._shunned[leader.peer_id] = tuple(excluded)
            step.down.add(leader.peer_id)
            return None
        return group

    async def _refused_by(self, step: _Step, leader: Candidate, response: averaging_pb2.JoinResponse,
                          straight: bool) -> None:
        """Takes a leader's refusal into account before the step asks again."""
        logger.debug("leader %s refused: %s", leader.peer_id[-8:], response.reason)
        if "schema" in response.reason:
            raise AveragingError(f"leader {leader.peer_id} averages other tensors: {response.reason}")
        started = response.reason.startswith(_STARTED)
        if straight and not (step.key and started and response.started_group_key == step.key):
            return
        if started and self.config.adaptive:
            # it is in a group of this round already: look for the next one now, not after a pause
            step.down.add(leader.peer_id)
            step.missed = f"the group of {leader.peer_id[-8:]} started without this peer ({response.reason})"
            MATCHMAKING_MISSED.labels(self.prefix).inc()
            return
        if response.reason == "not the leader":
            # our view of who is down may be what sent us there: look again, but keep the leaders
            # this step saw vanish itself. The next leader is often still waiting on the same
            # vanished leader (it notices later); asking it again soon makes one group of them
            # (followers going back to the vanished leader came too late and scattered).
            step.down = set(step.vanished)
        await asyncio.sleep(self.config.retry_interval * (1 + random.random()))

    async def _leader_vanished(self, leader: Candidate, channel: PeerChannel,
                               join: asyncio.Future[averaging_pb2.JoinResponse]) -> bool:
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
            racing: set[asyncio.Future[averaging_pb2.JoinResponse] | asyncio.Task[peer_pb2.PeerInfo]] = {join, probe}
            done, _ = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
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
        refusal = self._join_refusal(request, ctx)
        if refusal is not None:
            return refusal
        member = MemberInfo.from_proto(request.member)
        loop = asyncio.get_running_loop()
        previous = self._joiners.pop(member.peer_id, None)
        if previous is not None and not previous.answer.done():
            previous.answer.set_result(averaging_pb2.JoinResponse(accepted=False, reason="joined again"))
        key = request.group_key
        joiner = _Joiner(member, loop.time() + max(0.0, request.timeout), loop.create_future(), loop.time(),
                         frozenset(request.excludes), key)
        self._joiners[member.peer_id] = joiner
        self._arrived.set()
        try:
            if self._holds(key) and self._step is None:
                # held for this peer's next step: at most `max_wait`, so a leader that stopped
                # stepping does not keep its last group's members from the DHT for long
                try:
                    return await asyncio.wait_for(asyncio.shield(joiner.answer), min(request.timeout, self.config.max_wait))
                except TimeoutError:
                    if self._step is None or self._step.key != key:
                        return self._answer(joiner, "not leading a group of that round yet")
            left = joiner.timeout_at - loop.time()
            return await asyncio.wait_for(asyncio.shield(joiner.answer), max(0.01, left))
        except TimeoutError:
            return self._answer(joiner, "no group formed in time")
        finally:
            if self._joiners.get(member.peer_id) is joiner:
                del self._joiners[member.peer_id]

    def _join_refusal(self, request: averaging_pb2.JoinRequest, ctx: CallContext) -> averaging_pb2.JoinResponse | None:
        """The answer to a join this peer does not hold for a group (None: it holds it)."""
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
        key, step = request.group_key, self._step
        missed = (averaging_pb2.JoinResponse(accepted=False, reason=f"{_STARTED}: this peer is in round "
                                             f"{self._last_round.hex()[:8]}", started_group_key=self._last_key or "")
                  if self._last_round is not None and self.config.adaptive else None)
        if step is not None and step.key and key and key != step.key:
            # a group of another round: never mix rounds in one group
            if key == self._last_key and missed is not None:
                return missed
            return averaging_pb2.JoinResponse(accepted=False, reason=f"this peer looks for the group of {step.key!r}")
        if not self._holds(key) and not self._may_lead():
            if step is None and missed is not None:
                return missed
            return averaging_pb2.JoinResponse(accepted=False, reason="not the leader")
        return None

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
        step = self._step
        return (self.config.follow_last_leader and bool(key) and self._led_last and key != self._last_key
                and self.peer.server is not None
                and (step is None or (key == step.key and not step.following)))

    def _end_of_step(self, step: _Step, group: GroupInfo | None) -> None:
        """Records the step's group for the next step's matchmaking and answers the joins still
        waiting for this step's group: it formed without them, or none formed here."""
        if group is None:
            self._last_round, self._last_leader, self._led_last = None, None, False  # the next try asks the DHT
        else:
            self._last_round, self._last_key, self._last_size = group.round_id, step.key, len(group.members)
            self._joined_rounds.append(group.round_id.hex())
            leader = group.leader
            self._led_last = leader.peer_id == step.me.peer_id
            self._last_leader = None if self._led_last else Candidate(leader.peer_id, leader.addr)
        if group is None or not self.config.adaptive:
            refusal = averaging_pb2.JoinResponse(accepted=False, reason="not the leader")
        else:
            refusal = averaging_pb2.JoinResponse(accepted=False, reason=f"{_STARTED}: this peer is in round "
                                                 f"{group.round_id.hex()[:8]}", started_group_key=step.key or "")
        for j in list(self._joiners.values()):
            if not j.answer.done() and (not j.key or j.key == step.key):
                j.answer.set_result(refusal)

    def _refuse_other_rounds(self, key: str) -> None:
        """At a step's start: joins held for another round than this step's (`key`) are refused,
        so their followers look in the DHT at once."""
        for j in list(self._joiners.values()):
            if j.key and j.key != key and not j.answer.done():
                j.answer.set_result(averaging_pb2.JoinResponse(
                    accepted=False, reason=f"this peer looks for the group of {key!r}"))

    def _may_lead(self) -> bool:
        if self._step is None:
            # Not averaging right now. A fixed group's leader is fixed, so hold the call until our
            # next step (refused then if we follow someone else); a DHT follower looks again.
            return self.peer.server is not None and self.election.fixed
        return self._step.leading

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

    def _outstanding(self, step: _Step, now: float, expected_at: dict[str, float], bound: float) -> dict[str, float]:
        """Declared peers not in yet -> loop time until which this leader waits for them.

        A peer is expected at its announced readiness or, if that passed, when this leader first
        saw its declaration; it is waited for `bound` seconds past that.
        """
        wall = get_dht_time()
        out: dict[str, float] = {}
        declared = self.election.declared(step.me)
        for peer_id, declaration in declared.items():
            if peer_id in step.down:
                continue
            if peer_id not in expected_at:
                expected_at[peer_id] = max(now, now + declaration.ready_at - wall)
            joiner = self._joiners.get(peer_id)
            if joiner is not None and not joiner.answer.done():
                continue
            until = expected_at[peer_id] + bound
            if until > now:
                out[peer_id] = until
        if step.expect_unnamed and 1 + len(declared) < step.start_size:
            # more peers are expected than declared (client-mode members of a static group are not
            # listed; training progress names peers that have not declared yet): wait for them too
            until = expected_at.setdefault("", now) + bound
            if until > now:
                out[""] = until
        return out

    def _leads_again(self, step: _Step, expected_size: int | None) -> bool:
        """Whether this step may lead its last group's members again without the DHT
        (`follow_last_leader`): this peer led that group, keys name rounds, and the peers expected
        (training progress says how many) are no more than that group held, so every one of them
        can come straight here (a newcomer, which only the DHT can lead here, makes it declare)."""
        return (self.config.follow_last_leader and bool(step.key) and self._led_last
                and self._last_key is not None and self._last_key != step.key and self.peer.server is not None
                and expected_size is not None and expected_size <= min(self._last_size, self.config.target_group_size))

    async def _lead_again(self, step: _Step, deadline: float) -> GroupInfo | None:
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
        step.leading = True
        try:
            while True:
                now = loop.time()
                if 1 + len(self._keep_apart(self._live(now))[0]) >= step.start_size:
                    return self._start(step.me, now, deadline, led_at, "every expected peer came straight", bound, {})
                if now >= until:
                    logger.debug("round %s: not every expected peer came straight within %.3f s; declaring",
                                 step.key, until - led_at)
                    return None
                await self._wait_for_arrival(until - now)
        finally:
            step.leading = False

    async def _wait_for_arrival(self, seconds: float) -> None:
        """Until a joiner arrives or `seconds` pass."""
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), max(0.001, seconds))
        except TimeoutError:
            pass

    async def _lead(self, step: _Step, start: float, deadline: float, waited_from: float | None = None) -> GroupInfo | None:
        """Waits for this peer's group to fill (see `_Lead`) and starts it; None if this peer
        should stop leading (another leads, or the deadline passed)."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        rtt = self._link.rtt()
        bound = self.spread.bound(rtt) + self.election.patience()
        lead = _Lead(
            led_at=loop.time(), latest_start=start + cfg.matchmaking_share * (deadline - start), deadline=deadline,
            bound=bound,
            # A peer that missed its round's group waits for another group of that round only while a
            # declared peer may still come (`outstanding`, up to `bound` each) and for its slowest
            # declaration exchange and a few round trips for a peer that declared just as it did:
            # the peers whose rounds all started without it are done, and waiting `bound` for peers
            # nobody declared kept it out of phase with its next round.
            missed_wait=min(bound, max(cfg.min_wait, self.election.read_seconds) + 4 * (rtt or 0.05)),
            # peers expected without a declaration are waited for from when `_lead_again` began waiting
            expected_at={"": waited_from} if waited_from is not None else {},
        )
        lead.next_poll = lead.refreshed_at = lead.led_at
        lead.next_poll += cfg.poll_interval
        while True:
            now = loop.time()
            why = self._why_start(step, lead, now)
            if why == _LOOK_AGAIN:  # a peer may have declared meanwhile: look once more first
                await self.election.refresh(step.me)
                lead.refreshed_at = loop.time()
                continue
            if why:
                return self._start(step.me, loop.time(), deadline, lead.led_at, why, bound, lead.outstanding,
                                   lead.expected_at)
            if now >= deadline:
                return None
            if now >= lead.next_poll and (not self.election.fixed or step.down):
                lead.next_poll = now + cfg.poll_interval
                lead.refreshed_at = now
                if await self.election.outranked(step.me, step.down, self._answers):
                    self._refuse_all("the leader changed")
                    return None
            await self._wait_for_arrival(lead.wake(now, self._window(), step.missed is not None))

    def _window(self) -> float:
        # a follower reads the same declarations: the window covers the slowest read (or store)
        # this peer saw (a crashed replica holds each read for the DHT's request timeout), and a
        # follower's first read that still waits on the dead nodes this peer already passes over
        # (`patience`: one request timeout while this peer's DHT knows such nodes, else 0)
        return max(self.config.join_window, self.election.read_seconds, self.election.patience())

    def _why_start(self, step: _Step, lead: _Lead, now: float) -> str:
        """Why this leader starts its group now ("": not yet; `_LOOK_AGAIN`: after one more look
        at the declarations); raises `AveragingError` when this step missed its round's group
        and no other peer is coming for another group of it."""
        cfg = self.config
        window = self._window()
        size = 1 + len(self._keep_apart(self._live(now))[0])
        if cfg.adaptive:
            lead.outstanding = self._outstanding(step, now, lead.expected_at, lead.bound)
        if size >= step.start_size:
            return "target size" if step.start_size == cfg.target_group_size else "expected size"
        if size >= cfg.min_group_size:
            if lead.min_met_at is None or size > lead.last_size:
                # the window restarts with every arrival: followers reach the leader spread
                # over a few round trips, so one window from the first is too short
                lead.min_met_at = now
            lead.last_size = size
            if now >= lead.latest_start:
                return "matchmaking share of the timeout spent"
            if not cfg.adaptive and now >= lead.min_met_at + window:
                return "join window"
            if cfg.adaptive and not lead.outstanding and now >= lead.min_met_at + window:
                if lead.refreshed_at < lead.min_met_at + window:
                    return _LOOK_AGAIN
                return "every declared peer is in or past its wait bound"
        elif cfg.adaptive and step.missed is not None and not lead.outstanding and now >= lead.led_at + lead.missed_wait:
            if lead.refreshed_at < lead.led_at + lead.missed_wait:  # look once more before giving up
                return _LOOK_AGAIN
            raise AveragingError(f"{step.missed}, and no other peer is coming for another group of it "
                                 f"(waited {now - lead.led_at:.2f} s; no declared peer is still looking)")
        return ""

    async def _answers(self, candidate: Candidate) -> bool:
        """Whether `candidate` answers an Info call within a few of its round trips."""
        timeout = self._link.deadline(candidate.peer_id, 0, multiple=4, floor=0.05, cap=self.config.poll_interval)
        try:
            await self.peer.pool.get(candidate.addr).info(timeout=timeout)
        except RPCError:
            return False
        return True

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

    def _refuse_all(self, reason: str) -> None:
        for j in list(self._joiners.values()):
            if not j.answer.done():
                j.answer.set_result(averaging_pb2.JoinResponse(accepted=False, reason=reason))
