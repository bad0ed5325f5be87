"""`swarm.Averager`: average a list of tensors in place with a group of peers.

    avg = swarm.Averager(peer, [p.data for p in model.parameters()], prefix="run", target_group_size=4)
    result = avg.step(timeout=30)      # the tensors now hold the group's weighted mean
    result.contributors, result.weights

Each step finds a group (`matchmaking`), runs one butterfly all-reduce over it (`allreduce`),
and either writes the mean of the agreed contributors into the tensors or raises
`AveragingError` with the tensors untouched (docs/architecture.md, "Life of an averaging step").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swarm.averaging.buffers import ScratchPool
from swarm.averaging.config import AllReduceConfig, fold_schema
from swarm.averaging.election import DHTElection, Election, StaticElection
from swarm.averaging.faults import FaultPoint
from swarm.averaging.group import GroupInfo, MemberInfo
from swarm.averaging.matchmaking import Matchmaking, MatchmakingConfig
from swarm.averaging.partition import FlatTensors, schema_digest
from swarm.averaging.reputation import Reputation, ReputationConfig
from swarm.averaging.robust import MIN_CONTRIBUTORS
from swarm.averaging.round import AveragingResult, AveragingRound, RoundTimeline
from swarm.averaging.service import AveragingService
from swarm.averaging.verification import ReducerLied
from swarm.compression import CompressionType
from swarm.core.errors import AveragingError, ConfigError
from swarm.core.faults import FaultInjected, FaultPlan
from swarm.core.multiaddr import is_relayed
from swarm.core.timeutil import get_dht_time
from swarm.dht.handle import PeerHandle
from swarm.metrics import AVERAGING_ROUNDS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AveragerConfig:
    """Settings of an `Averager` beyond its constructor's main arguments.

    Attributes:
        allreduce: chunk size and the round's timeline.
        matchmaking: group sizes and waits.
        compression: wire codec for the tensors (a `swarm.compression.CompressionType`).
        bandwidth: this peer's relative bandwidth; parts are sized in proportion to it.
        reputation: in robust mode, when a contributor clipped hard, or a reducer this peer's
            own checks caught lying, is kept out of the groups this peer leads
            (`swarm.averaging.reputation`).
    """

    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    matchmaking: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    compression: CompressionType = CompressionType.NONE
    bandwidth: float = 1.0
    reputation: ReputationConfig = field(default_factory=ReputationConfig)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "compression", CompressionType(self.compression))
        except ValueError:
            raise ConfigError(f"unknown compression type {self.compression}") from None
        if not (math.isfinite(self.bandwidth) and self.bandwidth >= 0):
            raise ConfigError("bandwidth must be finite and >= 0")


SHUTDOWN_GRACE = 3.0
"""Seconds a shutting-down averager waits for its last round's results to reach the other members
before it cuts their streams (in the usual case they are in within a round trip)."""

RELAYED_BANDWIDTH = 0.25
"""The share of its bandwidth a peer reached through a relay declares (docs/relay.md): its part of
an all-reduce crosses the relay too, on the relay's bandwidth share, so parts go mostly to
reducers that others reach directly."""


def declared_bandwidth(addrs: Sequence[str], bandwidth: float) -> float:
    """The bandwidth a member declares: `bandwidth`, or a `RELAYED_BANDWIDTH` share of it when the
    address it declares (its first) is relayed."""
    return bandwidth * RELAYED_BANDWIDTH if addrs and is_relayed(addrs[0]) else bandwidth


def _with_group_sizes(config: AveragerConfig | None, target: int | None, minimum: int | None) -> AveragerConfig:
    """`config` with the group sizes given as `Averager` arguments (their home is `MatchmakingConfig`;
    the arguments are a shorthand that replaces what the config says)."""
    config = config or AveragerConfig()
    if target is None and minimum is None:
        return config
    matchmaking = config.matchmaking
    return dataclasses.replace(config, matchmaking=dataclasses.replace(
        matchmaking,
        target_group_size=matchmaking.target_group_size if target is None else target,
        min_group_size=matchmaking.min_group_size if minimum is None else minimum,
    ))


def _robust_sizes(config: AveragerConfig) -> AveragerConfig:
    """Robust mode groups at least `MIN_CONTRIBUTORS` peers: two cannot tell a liar from an
    honest member (docs/architecture.md, "Robust averaging", small groups)."""
    matchmaking = config.matchmaking
    if not config.allreduce.robust or matchmaking.min_group_size >= MIN_CONTRIBUTORS:
        return config
    if matchmaking.target_group_size < MIN_CONTRIBUTORS:
        raise ConfigError(f"robust mode needs groups of at least {MIN_CONTRIBUTORS} (of two, nobody can tell the "
                          f"liar from the honest one), got target_group_size={matchmaking.target_group_size}")
    return dataclasses.replace(config, matchmaking=dataclasses.replace(matchmaking, min_group_size=MIN_CONTRIBUTORS))


class Averager:
    """Averages `tensors` in place with other peers, one group per `step`.

    Args:
        peer: the local `swarm.Peer`.
        tensors: floating-point tensors averaged in place (any shapes; the same on every peer).
            With `auxiliary=True` they only give the shapes and are never read or written.
        prefix: names this averager; peers average with peers of the same prefix.
        target_group_size: a group starts as soon as it has this many members; given, it replaces
            ``config.matchmaking.target_group_size`` (default 4), where the setting lives.
        min_group_size: fewest members a round may have; given, it replaces
            ``config.matchmaking.min_group_size`` (default 2; robust mode raises it to 3).
        initial_group: multiaddrs of the peers to average with (a "static group": the smallest
            PeerID leads). Without it the group is found through the DHT (`peer.dht`).
        auxiliary: this peer has no tensors and only helps reduce (needs a server).
        group_key: which DHT group to look for (see `matchmaking.moshpit_group_key`).
        config: further settings.
        faults: a fault plan for tests.
    """

    def __init__(
        self, peer: PeerHandle, tensors: Sequence[torch.Tensor], prefix: str = "run",
        target_group_size: int | None = None, min_group_size: int | None = None, *, initial_group: Sequence[str] | None = None, auxiliary: bool = False,
        group_key: str = "0", config: AveragerConfig | None = None, faults: FaultPlan | None = None,
    ) -> None:
        if not prefix or "/" in prefix:
            raise ConfigError(f"prefix must be a non-empty name without '/', got {prefix!r}")
        self.peer = peer
        self.prefix = prefix
        self.tensors = list(tensors)
        self.auxiliary = auxiliary
        if not self.tensors:
            raise ConfigError("an averager needs tensors (an auxiliary one: tensors of the same shapes, never written)")
        if auxiliary and peer.server is None:
            raise ConfigError("an auxiliary averager must accept connections (not client mode)")
        self.config = _robust_sizes(_with_group_sizes(config, target_group_size, min_group_size))
        self.faults = faults if faults is not None else FaultPlan()
        self.numel = sum(t.numel() for t in self.tensors)
        self.flat = None if auxiliary else FlatTensors(self.tensors)
        # peers with other aggregation settings never group with this one (docs/architecture.md)
        self.schema = fold_schema(schema_digest(self.tensors), self.config.allreduce.aggregation_tag())
        self._scratch = ScratchPool()
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task[object]] = set()
        self._formed: bool | None = None  # during a step: whether its group formed yet
        self._forming: asyncio.Task[GroupInfo] | None = None
        self._abandoned: str | None = None
        self._closed = False
        election: Election
        if initial_group is not None:
            election = StaticElection(initial_group)
        else:
            if peer.dht is None:
                raise ConfigError("no DHT on this peer: pass initial_group=[multiaddrs] to average with")
            election = DHTElection(peer.dht, prefix, group_key)
        self.service = AveragingService.of(peer)
        self.matchmaking = Matchmaking(
            peer, prefix, self.schema, self.numel, election, self.config.matchmaking,
            self.config.compression, self.config.allreduce.chunk_bytes,
        )
        self.reputation = Reputation(peer.peer_id, self.config.reputation)
        if self.config.allreduce.robust:
            self.matchmaking.refuse = self.reputation.refusal
            self.matchmaking.excluding = self.reputation.excluded_peers
        peer.attach(self)

    # -- public API --------------------------------------------------------------------------

    def step(self, timeout: float = 30.0, weight: float = 1.0, group_key: str | None = None,
             expected_size: int | None = None) -> AveragingResult:
        """Averages the tensors with one group, in place.

        Args:
            timeout: seconds for the whole step (finding a group and averaging).
            weight: this peer's weight in the mean (e.g. its number of samples); 0 only listens.
            group_key: DHT group to look for in this step (e.g. `moshpit_group_key(round, coords)`);
                None keeps the current one. Ignored for a static group.
            expected_size: peers known to want this round; a leader starts once that many are in
                (between `min_group_size` and `target_group_size`) rather than waiting for more.

        Returns:
            The round's group, contributors and weights (the same on every member).

        Raises:
            AveragingError: no group formed, or the round failed; the tensors are untouched.
        """
        return self.peer.run(self.astep(timeout, weight, group_key, expected_size), timeout=timeout + 5.0)

    async def astep(self, timeout: float = 30.0, weight: float = 1.0, group_key: str | None = None,
                    expected_size: int | None = None) -> AveragingResult:
        """Awaitable form of `step`, for code already inside an event loop."""
        return await self.peer.loop.wrap(self._step(timeout, weight, group_key, expected_size))

    def announce(self, ready_in: float, group_key: str | None = None) -> bool:
        """Tells the peers of a DHT group that this peer will step in about `ready_in` seconds.

        A leader of that group then waits for this peer (up to the bound it learned past that
        time) instead of starting without it. Call before computing what the step averages; the
        announcement lapses `config.matchmaking.max_wait` seconds after that time (the step's
        timeout must reach past it, so that its declaration replaces the announcement). Returns whether it was stored (always
        False for a static group, whose leader expects every member anyway).
        """
        if not (math.isfinite(ready_in) and ready_in >= 0):
            raise ValueError(f"ready_in must be a finite number >= 0, got {ready_in}")
        return self.peer.run(self.aannounce(ready_in, group_key), timeout=30.0)

    async def aannounce(self, ready_in: float, group_key: str | None = None) -> bool:
        """Awaitable form of `announce`."""
        election = self.matchmaking.election
        me = MemberInfo(self.peer.peer_id, self.peer.addrs[0] if self.peer.addrs else "",
                        0.0 if self.auxiliary else 1.0, declared_bandwidth(self.peer.addrs, self.config.bandwidth), self.peer.server is None, self.auxiliary)
        bound = self.matchmaking.config.max_wait
        now = get_dht_time()

        async def store() -> bool:
            return await election.announce(me, now + ready_in, now + ready_in + bound, group_key)

        return await self.peer.loop.wrap(store())

    def abandon_matchmaking(self, reason: str) -> bool:
        """Stops the running step if it is still looking for a group (call on the peer's loop).

        A step that already formed its group is not touched (its members count on it). Returns
        True when the step stopped looking; it then raises `AveragingError` naming `reason`,
        with the tensors untouched.
        """
        if self._formed is not False:
            return False
        self._abandoned = reason
        if self._forming is not None:
            self._forming.cancel()
        return True

    def shutdown(self) -> None:
        if not self._closed:
            self.peer.run(self.ashutdown(), timeout=10)

    async def ashutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.matchmaking.close()
        tasks = list(self._background)
        if tasks:
            # The last round's members may still be fetching the parts this peer reduced: its step
            # returned once its own parts were in. Let those results finish (a release ends when
            # every stream to this peer closed) before cutting the streams, so a peer that leaves
            # right after a step does not fail the round it just completed for the others.
            await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE)
        for task in tasks:
            task.cancel()
        if tasks:  # a release's cleanup, and its streams' cancellation, run before the loop stops
            await asyncio.wait(tasks, timeout=5.0)
        self.peer.detach(self)

    # -- one step ----------------------------------------------------------------------------

    async def _step(self, timeout: float, weight: float, group_key: str | None = None,
                    expected_size: int | None = None) -> AveragingResult:
        if self._closed:
            raise AveragingError("this averager was shut down")
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a positive number, got {timeout}")
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        async with self._lock:
            # a key given to this step names its round: a group under it that started without
            # this peer was its round's group (see `matchmaking`)
            self.matchmaking.election.name_round(group_key)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            self._formed, self._abandoned = False, None
            try:
                await self.faults.hit(FaultPoint.BEFORE_MATCHMAKING)
                me = MemberInfo(
                    self.peer.peer_id, self.peer.addrs[0] if self.peer.addrs else "",
                    0.0 if self.auxiliary else weight, declared_bandwidth(self.peer.addrs, self.config.bandwidth), self.peer.server is None, self.auxiliary,
                )
                group = await self._form_group(me, timeout, expected_size)
                self._formed = True
                result = await self._run_round(group, deadline)
                for peer_id in self.reputation.observe(result.clipped):
                    logger.warning("averager %s: excluding %s from the groups it leads for %.0f s (clipped hard "
                                   "in %d rounds)", self.prefix, peer_id, self.config.reputation.exclusion,
                                   self.config.reputation.strikes)
                AVERAGING_ROUNDS.labels(outcome="succeeded").inc()
                return result
            except FaultInjected as e:
                AVERAGING_ROUNDS.labels(outcome="failed").inc()
                raise AveragingError(f"averaging step failed: {e}") from None
            except AveragingError as e:
                AVERAGING_ROUNDS.labels(outcome="failed").inc()
                if isinstance(e, ReducerLied) and self.reputation.observe_lie(e):
                    logger.warning("averager %s: excluding %s from the groups it leads for %.0f s (caught lying "
                                   "by this peer's checks in %d rounds)", self.prefix, e.peer_id,
                                   self.config.reputation.exclusion, self.config.reputation.lies)
                raise
            finally:
                self._formed = None
                self.faults.round_index += 1

    async def _form_group(self, me: MemberInfo, timeout: float, expected_size: int | None) -> GroupInfo:
        """`matchmaking.form_group`, in a task `abandon_matchmaking` may cancel."""
        if self._abandoned is not None:
            raise AveragingError(f"stopped looking for a group: {self._abandoned}")
        self._forming = asyncio.ensure_future(self.matchmaking.form_group(me, timeout, expected_size))
        try:
            return await self._forming
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._abandoned is None or (current is not None and current.cancelling()):
                raise  # the step itself was cancelled
            raise AveragingError(f"stopped looking for a group: {self._abandoned}") from None
        finally:
            self._forming = None

    async def _run_round(self, group: GroupInfo, deadline: float) -> AveragingResult:
        """The all-reduce over `group` (`round.AveragingRound`), within the step's `deadline`."""
        timeline = RoundTimeline.of(group, deadline, self.config.allreduce, self.config.matchmaking.adaptive,
                                    self.config.matchmaking.round_timeout_multiple)
        return await AveragingRound(
            self.peer, group, self.flat, timeline, self.faults, self.service, self.matchmaking.timing, self._scratch,
            adopt=self._adopt, closing=lambda: self._closed,
        ).run()

    def _adopt(self, task: asyncio.Task[object]) -> None:
        """Keeps `task` (a round's release, a stream left to end) until it ends; cancelled at shutdown."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

