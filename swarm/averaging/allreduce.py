"""Butterfly all-reduce, member side: send part j to reducer j, get the mean of part j back.

One bidirectional stream per (member, reducer) pair carries the member's part out and the
averaged part back (so client-mode members, which only dial out, take part). The member's own
part is reduced locally. Results land in a buffer, never in the tensors, until every part is
held under the same decision; only then are they written in place. A part whose reducer died
while sending it back is fetched from another server-mode member that holds it; when no one
does, the round fails for every member alike (see `agreement` and `reducer`).

The protocol of a Reduce stream, sender -> reducer: `ReduceHeader`, the part's chunks, then a
`SenderAck` once the sender holds the averaged part; the sender closes its side when it is done
with the round. Reducer -> sender: `ResultHeader` (the decision's exact bytes, or abort), then
the averaged part's chunks.

Recovering a lost part (the functions after the class): a member that lost part j asks the
members that may hold it (its reducer first, then every other server-mode member with tensors)
over ``Fetch``; a holder answers once its own copy of the part is settled, with the exact float32
values it holds and the decision's bytes. Holders keep a round's results until every member
closed its streams to them (see `averager._release`), so a member that could not get a part
from anyone knows that no one else applied the round either.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import torch

from swarm.averaging.agreement import Decision
from swarm.averaging.config import AllReduceConfig
from swarm.averaging.faults import FaultPoint
from swarm.averaging.group import GroupInfo
from swarm.averaging.liveness import refuses_connections
from swarm.averaging.lockstep import Lockstep
from swarm.averaging.partition import FlatTensors, chunk_bounds
from swarm.averaging.parts import ClaimFields, Part, PartState, RoundFailed, plan_parts, scratch_numel
from swarm.averaging.reducer import PartReducer, ReportFn, encode_failure_message, is_raw_float32
from swarm.averaging.service import FETCH, REDUCE
from swarm.compression import Codec, CompressionError, get_codec
from swarm.compression.base import HEADER_SIZE
from swarm.core.errors import InvalidRequest, NotFound
from swarm.core.faults import FaultInjected, FaultPlan
from swarm.core.loop import spawn
from swarm.dht.handle import PeerHandle
from swarm.metrics import REGISTRY
from swarm.net.bulk import Sink, Sunk
from swarm.net.estimates import LinkEstimates
from swarm.net.frames import Frames
from swarm.proto import averaging_pb2

if TYPE_CHECKING:
    import numpy

logger = logging.getLogger(__name__)

PART_FETCHES = REGISTRY.counter(
    "swarm_averaging_part_fetches_total", "Parts this member asked other members for, by why: its stream "
    "to the reducer broke (failed), or sent nothing for its silence limit after the round was decided (stalled)",
    ("why",))


RoundCheck = Callable[["ButterflyAllReduce", Decision], Awaitable[None]]
"""A member's check of a decided round before it applies the mean (verified rounds: the audit,
`round.AveragingRound`); raises to stop the round for everyone alike."""

END_WAIT = 5.0  # seconds a held part's stream may take to end by itself once the round is closed
SILENCE_MULTIPLE = 4.0  # a streaming peer silent this many times its expected chunk time is given up on
SILENCE_FLOOR = 1.0     # seconds (as the round-wide stall limit's floor, `round.RoundTimeline.of`)


def silence_limit(estimates: LinkEstimates, peer_id: str, chunk_bytes: int, cap: float) -> float:
    """How long a peer that is streaming a part (to its reducer, or the mean back) may stay silent
    before the other side gives up on it: `SILENCE_MULTIPLE` times what one chunk from that peer
    should take by its own link estimates (RTO plus the chunk over its measured throughput), within
    [`SILENCE_FLOOR`, `cap`]; `cap` (the round's `sender_timeout`) for a link never measured. A
    stalled peer on a fast link so costs a multiple of its link's time, not one round-wide constant."""
    return estimates.deadline(peer_id, chunk_bytes, multiple=SILENCE_MULTIPLE, floor=SILENCE_FLOOR, cap=cap)


class ButterflyAllReduce:
    """One round of butterfly all-reduce on this member.

    Args:
        peer: the local `swarm.Peer` (its channel pool is used to dial reducers).
        group: the round's group.
        flat: this member's tensors as one flat vector (None for auxiliary members).
        scratch: float32 buffer of at least `scratch_numel(group, my index)` elements.
        config: timeouts and chunk size.
        faults: fault plan.
        timeout: seconds this round may take from now.
        report: how this member's reducer reports to the leader (local call or RPC).
    """

    def __init__(
        self, peer: PeerHandle, group: GroupInfo, flat: FlatTensors | None, scratch: torch.Tensor,
        config: AllReduceConfig, faults: FaultPlan, timeout: float, report: ReportFn, verify: RoundCheck | None = None,
        on_gone: Callable[[int], None] | None = None,
    ) -> None:
        self.peer, self.group, self.flat, self.config, self.faults = peer, group, flat, config, faults
        self.verify = verify  # verified rounds: the member's audit of the parts before it applies the mean
        # told the index of a member this member found gone (the leader's `Coordinator.member_gone`:
        # the reducers may all have reported before that member died, naming no broken stream)
        self.on_gone = on_gone
        self.my_index = group.index_of(peer.peer_id)
        self.me = group.members[self.my_index]
        self.codec: Codec = get_codec(group.compression)
        loop = asyncio.get_running_loop()
        self.t0 = loop.time()
        self.timeout = timeout
        self.deadline = self.t0 + timeout
        sizes, offsets = plan_parts(group)
        self.my_part = group.part_of(self.my_index)
        self.chunk_numel = self.codec.chunk_numel(config.chunk_bytes)
        self.parts = [Part(j, offsets[j], sizes[j], r) for j, r in enumerate(group.reducers)]
        self.reducer = self._make_reducer(scratch, report)
        self._place_parts(scratch)
        estimates = peer.pool.estimates
        self.silence = {i: silence_limit(estimates, m.peer_id, config.chunk_bytes, config.sender_timeout)
                        for i, m in enumerate(group.members) if i != self.my_index}
        if self.reducer is not None:
            self.reducer.silence_limits = self.silence
        self.results_arriving = asyncio.Event()  # another reducer's mean has started to arrive here
        if self.reducer is not None and self.my_index == 0 and self.me.is_sender and len(self.parts) > 1:
            self.reducer.hold = self.results_arriving  # the leader decides first: its mean waits for the others'
        logger.debug("round %s: silence limits %s (sender_timeout %.2f s)", group.round_id.hex()[:8],
                     {group.members[i].peer_id[-6:]: round(v, 2) for i, v in self.silence.items()},
                     config.sender_timeout)
        # this member's parts go out level with each other (`lockstep`), patient with each reducer
        # for its silence limit
        sending = [p for p in self.parts if p.index != self.my_part and p.size and self.me.is_sender
                   and self.me.weight > 0]
        self.lockstep = Lockstep([p.index for p in sending], config.lockstep,
                                 {p.index: self.silence.get(p.reducer, config.sender_timeout) for p in sending})
        self.finished = asyncio.Event()   # this member is done with the round (its streams may close)
        # a part of this round will never be averaged (its reducer aborted it): no member can apply
        # the round, so no one will fetch its results from us (the round's buffer may go at once)
        self.doomed = asyncio.Event()
        self.sent_chunks = 0
        self.received_chunks = 0
        self._changed = asyncio.Event()
        self._decided_at: float | None = None  # loop time this member first learned the round's decision
        self._tasks: list[asyncio.Task[object]] = []
        self._probed: set[int] = set()  # members whose address this member probed (`_suspect`)

    def _make_reducer(self, scratch: torch.Tensor, report: ReportFn) -> PartReducer | None:
        """The reducer of the part this member averages (None where it reduces no part).

        It takes the end of `scratch`: the others' contributions, then its accumulator."""
        if self.my_part is None:
            return None
        p = self.parts[self.my_part]
        total = scratch_numel(self.group, self.my_index)
        return PartReducer(
            self.group, self.my_index, self.my_part, p.start, p.size, self.flat, scratch[:total - p.size],
            scratch[total - p.size:total], self.codec, self.config, self.faults, self.t0, self.timeout, report,
        )

    def _place_parts(self, scratch: torch.Tensor) -> None:
        """Give each part that another member reduces its slice of `scratch`, where the mean arrives."""
        if not self.me.is_sender:
            return
        pos = 0
        for p in self.parts:
            if p.index != self.my_part:
                p.values = scratch[pos:pos + p.size]
                pos += p.size

    @property
    def round_tag(self) -> str:
        return self.group.round_id.hex()[:8]

    # -- running a round ---------------------------------------------------------------------

    async def run(self) -> Decision:
        """Runs the round; returns the decision whose mean is now in the tensors, or raises `RoundFailed`."""
        try:
            if self.reducer is not None:
                self.reducer.start()
            if self.me.is_sender:
                await self.faults.hit(FaultPoint.BEFORE_REDUCE_SCATTER)
                for p in self.parts:
                    p.last_progress = self.t0
                    if p.index == self.my_part:
                        self._tasks.append(spawn(self._local_part(p), name=f"avg-local-{self.round_tag}"))
                    else:
                        p.exchange = spawn(self._exchange(p), name=f"avg-x-{self.round_tag}-p{p.index}")
                        self._tasks.append(p.exchange)
                decision = await self._gather()
                if self.verify is not None:
                    await self.verify(self, decision)  # raises `ReducerLied` for everyone alike
                logger.debug("round %s: all parts in after %.3f s", self.round_tag, asyncio.get_running_loop().time() - self.t0)
                await self.faults.hit(FaultPoint.BEFORE_APPLY)
                late = asyncio.get_running_loop().time() - self.deadline
                if late > 0 and self.reducer is not None:
                    # Past our deadline (stalled, e.g. SIGSTOP): the others may have given up on
                    # the part we reduce. Apply only if every sender acknowledged holding it.
                    wait = min(self.config.sender_timeout, max(0.0, 0.9 - late))
                    if not await self.reducer.wait_acknowledged(wait):
                        raise RoundFailed(self.group.round_id, "timed out: others may lack the part reduced here")
                await asyncio.get_running_loop().run_in_executor(None, self._apply)
                logger.debug("round %s: applied after %.3f s", self.round_tag, asyncio.get_running_loop().time() - self.t0)
                return decision
            # auxiliary member: only reduces; its outcome is its own part's outcome
            assert self.reducer is not None
            await self._wait(self.reducer.finished)
            if self.reducer.aborted or self.reducer.decision is None:
                raise RoundFailed(self.group.round_id, self.reducer.abort_reason or "timed out")
            return self.reducer.decision
        except FaultInjected as e:
            raise RoundFailed(self.group.round_id, f"fault injected: {e}") from None
        finally:
            self.finished.set()

    async def _wait(self, event: asyncio.Event) -> None:
        remaining = self.deadline - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(event.wait(), max(0.0, remaining))
        except TimeoutError:
            raise RoundFailed(self.group.round_id, "timed out") from None

    async def _gather(self) -> Decision:
        loop = asyncio.get_running_loop()
        while True:
            states = [p.state for p in self.parts]
            aborted = [p for p in self.parts if p.state is PartState.ABORTED]
            if aborted:
                raise RoundFailed(self.group.round_id, aborted[0].reason)
            lost = [p for p in self.parts if p.state is PartState.LOST]
            if lost and all(s is not PartState.PENDING and s is not PartState.FAILED for s in states):
                raise RoundFailed(self.group.round_id, f"part(s) {[p.index for p in lost]} lost: "
                                  f"{lost[0].reason}")
            if all(s is PartState.COMPLETE for s in states):
                break
            now = loop.time()
            wake = self.deadline
            if self._decided_at is None and any(p.decision for p in self.parts):
                self._decided_at = now
            for p in self.parts:
                if p.fetch is not None or p.index == self.my_part:
                    continue
                if p.state is PartState.FAILED:
                    PART_FETCHES.labels(why="failed").inc()
                    p.fetch = spawn(fetch_part(self, p), name=f"avg-fetch-{self.round_tag}-p{p.index}")
                    self._tasks.append(p.fetch)
                elif p.state is PartState.PENDING and self._decided_at is not None:
                    # decided, but this part's stream stalls: its reducer may be gone. Ask the
                    # holders too, yet keep waiting on the stream until the deadline: a stalled
                    # reducer that resumes in time must not find us gone (agreement). Silence is
                    # counted from the decision at the earliest: no reducer sends a result before
                    # it, so a reduce-scatter longer than sender_timeout (a slow link) would
                    # otherwise have every member fetch every part a second time.
                    # The limit also leaves the holders half the time from the decision to the
                    # deadline: a round whose adaptive timeout is short must still ask them in
                    # time, or this member fails a round the others apply.
                    since = max(p.last_progress, self._decided_at)
                    limit = min(self.silence.get(p.reducer, self.config.sender_timeout),
                                max(0.0, (self.deadline - self._decided_at) / 2))
                    if now - since >= limit:
                        PART_FETCHES.labels(why="stalled").inc()
                        p.fetch = spawn(fetch_part(self, p), name=f"avg-fetch-{self.round_tag}-p{p.index}")
                        self._tasks.append(p.fetch)
                    else:
                        wake = min(wake, since + limit)
            remaining = self.deadline - loop.time()
            if remaining <= 0:
                missing = [p.index for p in self.parts if p.state is not PartState.COMPLETE]
                raise RoundFailed(self.group.round_id, f"timed out waiting for part(s) {missing}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.001, min(remaining, wake - now)))
            except TimeoutError:
                pass
        decisions = {p.decision for p in self.parts}
        if len(decisions) != 1:
            raise RoundFailed(self.group.round_id, "parts were reduced under different decisions")
        return Decision.from_bytes(decisions.pop())

    def resolve(self, p: Part, state: PartState, reason: str = "", decision: bytes = b"") -> None:
        if p.state in (PartState.COMPLETE, PartState.ABORTED, PartState.LOST):
            return
        if state is PartState.FAILED and p.state is PartState.FAILED:
            return
        if state is PartState.FAILED and p.fetch is not None and p.fetch.done():
            p.fetch = None  # the last fetch ran while the stream still had hope: fetch again
        p.state, p.reason = state, reason or p.reason
        if decision:
            p.decision = decision
        if state is not PartState.FAILED:
            p.resolved.set()
            if p.sink is not None:
                p.sink.detach()  # held, fetched or given up: nothing more is written into p.values
        p.settled.set()
        self._changed.set()

    def _apply(self) -> None:
        assert self.flat is not None
        for p in self.parts:
            if p.size == 0:
                continue
            if p.index == self.my_part:
                assert self.reducer is not None
                self.flat.write(p.start, self.reducer.result())
            else:
                assert p.values is not None
                self.flat.write(p.start, p.values)
        self.flat.commit()

    async def _local_part(self, p: Part) -> None:
        assert self.reducer is not None
        try:
            await self._wait(self.reducer.finished)
        except RoundFailed:
            self.resolve(p, PartState.ABORTED, "timed out")
            return
        if self.reducer.aborted or self.reducer.decision is None:
            self.resolve(p, PartState.ABORTED, self.reducer.abort_reason)
            self.doomed.set()
        else:
            self.resolve(p, PartState.COMPLETE, decision=self.reducer.decision.to_bytes())

    # -- the stream to one reducer -------------------------------------------------------------

    async def _requests(self, p: Part, cancel: asyncio.Event) -> AsyncIterator[Frames]:
        has_data = self.me.weight > 0 and p.size > 0
        yield averaging_pb2.ReduceHeader(
            prefix=self.group.prefix, round_id=self.group.round_id, part=p.index, sender=self.my_index,
            numel=p.size, has_data=self.me.weight > 0,
        ).SerializeToString()
        if has_data:
            assert self.flat is not None
            self._timeline("part %d: sending to its reducer", p.index)
            try:
                for a, b in chunk_bounds(p.size, self.chunk_numel):
                    await self.lockstep.turn(p.index)  # level with this member's other parts
                    try:
                        # views of our tensors where the codec allows (NONE): the bulk channel sends
                        # them without a copy; they stay unchanged until the round applies its result
                        payload = self.codec.encode_views(self.flat.read(p.start + a, p.start + b))
                    except CompressionError as e:
                        yield encode_failure_message(p.index, f"cannot encode: {e}")
                        break
                    yield payload
                    self.lockstep.sent(p.index)  # resumed: the chunk is on its connection
                    self.sent_chunks += 1
                    try:
                        await self.faults.hit(FaultPoint.AFTER_CHUNKS_SENT, self.sent_chunks)
                    except FaultInjected:
                        cancel.set()
                        await asyncio.Event().wait()  # the exchange cancels the call
            finally:
                self.lockstep.leave(p.index)
            self._timeline("part %d: sent to its reducer", p.index)
        await p.resolved.wait()
        if p.state is PartState.COMPLETE:
            yield averaging_pb2.SenderAck(part=p.index).SerializeToString()
        await self.finished.wait()

    async def _exchange(self, p: Part) -> None:
        reducer = self.group.members[p.reducer]
        cancel = asyncio.Event()
        loop = asyncio.get_running_loop()
        try:
            channel = self.peer.pool.get(reducer.addr)
            if self.codec.kind == 0 and p.values is not None:
                p.sink = Sink(self._chooser(p))
            stream = channel.stream(REDUCE, self._requests(p, cancel), timeout=max(0.01, self.deadline - loop.time()),
                                    bulk=self.config.bulk, sink=p.sink)
            receiver = asyncio.ensure_future(self._receive(p, stream))
            canceller = asyncio.ensure_future(cancel.wait())
            try:
                await asyncio.wait({receiver, canceller}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                canceller.cancel()
                if not receiver.done():
                    receiver.cancel()
                    await asyncio.gather(receiver, return_exceptions=True)
                elif not receiver.cancelled():
                    receiver.exception()  # retrieved here, raised below
            if receiver.cancelled():
                raise FaultInjected("stream dropped by a fault")
            receiver.result()
            if p.state is PartState.PENDING:
                self.resolve(p, PartState.FAILED, "stream ended early")
        except asyncio.CancelledError:
            if p.state is PartState.PENDING:
                self.resolve(p, PartState.FAILED, "stream cancelled")
            raise
        except Exception as e:  # noqa: BLE001 - a reducer that died or stalled is an expected event
            logger.debug("part %d stream from %s failed: %s", p.index, reducer.peer_id[-8:], e)
            self.resolve(p, PartState.FAILED, f"stream from reducer {reducer.peer_id[-8:]} broke ({e})")
            self._suspect(p.reducer)
        finally:
            self.lockstep.leave(p.index)  # a broken stream's requests may never resume: stop waiting for it

    def _suspect(self, index: int) -> None:
        """The stream to member `index` broke: probe its address once, and when it refuses the
        connection (the process is gone), this member's reducer stops waiting for its part at
        once instead of after a silence limit (a sender killed before it connected to us would
        otherwise hold our report until the report time)."""
        if index in self._probed or self.reducer is None or index not in self.reducer.senders:
            return
        self._probed.add(index)
        member = self.group.members[index]

        async def probe() -> None:
            loop = asyncio.get_running_loop()
            try:
                gone = await asyncio.wait_for(refuses_connections(member.addr),
                                              max(0.01, self.deadline - loop.time()))
            except (TimeoutError, OSError):
                return
            logger.debug("round %s: member %s %s, %.3f s after the start", self.round_tag, member.peer_id[-8:],
                         "is gone (connection refused)" if gone else "still accepts connections",
                         loop.time() - self.t0)
            if gone and self.reducer is not None:
                self.reducer.sender_gone(index)
            if gone and self.on_gone is not None:
                self.on_gone(index)

        self._tasks.append(spawn(probe(), name=f"avg-probe-{self.round_tag}-m{index}"))

    def _chooser(self, p: Part) -> Callable[[int, int], tuple[bytearray, numpy.ndarray] | None]:
        """Where result messages of part `p` go on the bulk channel: straight into `p.values` (after a
        scratch buffer for the codec's header), once the slots it shares memory with are free."""
        bounds = chunk_bounds(p.size, self.chunk_numel)

        def choose(index: int, length: int) -> tuple[bytearray, numpy.ndarray] | None:
            i = index - 1  # message 0 is the ResultHeader
            if not 0 <= i < len(bounds) or p.state is not PartState.PENDING or p.values is None:
                return None
            if self.reducer is not None and not self.reducer.slots_released.is_set():
                return None
            a, b = bounds[i]
            if length != self.codec.encoded_size(b - a):
                return None
            return bytearray(HEADER_SIZE), p.values[a:b].view(torch.uint8).numpy()

        return choose

    async def _receive(self, p: Part, stream: AsyncIterator[bytes | memoryview | Sunk]) -> None:
        header: averaging_pb2.ResultHeader | None = None
        bounds = chunk_bounds(p.size, self.chunk_numel)
        i = 0
        async for message in stream:
            p.last_progress = asyncio.get_running_loop().time()
            if header is None:
                header = averaging_pb2.ResultHeader.FromString(message)
                p.claim = header
                self.results_arriving.set()
                if header.decision and not p.decision:
                    p.decision = header.decision  # known decided: a stall from here on is a lost reducer
                    self._changed.set()
                self._timeline("part %d: result header in", p.index)
                if header.abort:
                    self.resolve(p, PartState.ABORTED, header.reason)
                    self.doomed.set()
                    return
                if header.compression != self.codec.kind:
                    raise InvalidRequest("reducer answered with another codec")
                if self.reducer is not None:
                    await self.reducer.slots_released.wait()  # results reuse the slots' memory
                if not bounds:
                    self.resolve(p, PartState.COMPLETE, decision=header.decision)
                continue
            if p.state is not PartState.PENDING:
                return  # fetched from another member meanwhile
            if i >= len(bounds):
                raise InvalidRequest("reducer sent more chunks than its part holds")
            a, b = bounds[i]
            assert p.values is not None
            if isinstance(message, Sunk):  # already in p.values: check what the header says
                if message.dropped or not is_raw_float32(message.views[0], b - a):
                    raise InvalidRequest("reducer sent a malformed chunk")
            else:
                self.codec.decode(message, p.values[a:b])
            i += 1
            self.received_chunks += 1
            await self.faults.hit(FaultPoint.AFTER_RESULTS_RECEIVED, self.received_chunks)
            if i == 1:
                self._timeline("part %d: first result chunk in", p.index)
            if i == len(bounds):
                self._timeline("part %d: last result chunk in", p.index)
                self.resolve(p, PartState.COMPLETE, decision=header.decision)
                self._observe_link(p)

    def _timeline(self, what: str, *args: object) -> None:
        """A point of the round's timeline in the debug log (`lab_averaging.py --diag`)."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("round %s: " + what + " at %.3f s", self.round_tag, *args,
                         asyncio.get_running_loop().time() - self.t0)

    def _observe_link(self, p: Part) -> None:
        """What this part's exchange says of the link to its reducer: its bytes out and back over
        the time it took (waiting for the other senders included, so it errs slow)."""
        if p.size:
            seconds = asyncio.get_running_loop().time() - self.t0
            self.peer.pool.estimates.observe_transfer(self.group.members[p.reducer].peer_id, 2 * p.size * 4, seconds)

    def serve_fetch(self, part: int) -> AsyncIterator[bytes]:
        """Streams part `part` as this member holds it, to a member that lost it (see `serve_part` below)."""
        return serve_part(self, part)

    def close(self, linger: bool = True) -> list[asyncio.Task[object]]:
        """Cancels whatever still runs for this round (at release or shutdown). With `linger`, the
        stream of a part held here is left to end by itself: this member's END is on its way
        (`finished`), and the reducer's comes back a round trip later, leaving the connection for
        the next round's stream (`ChannelConfig.bulk_pool`); it is cancelled after `END_WAIT`
        seconds. Cancelled at once, the member that finishes a round last (its release comes at
        once) lost every connection to its reducers and started the next round's all-gather on
        new, cold ones (network lab, benchmarks/history/BENCHMARKS-2026-12-05.md scenario 3).

        Returns the streams left to end by themselves (the caller cancels them if it shuts down
        first: a task pending when the loop stops is destroyed, with a warning)."""
        self.finished.set()
        for p in self.parts:
            if p.sink is not None:
                p.sink.detach()  # the scratch buffer is about to serve another round
        held = {id(p.exchange) for p in self.parts if p.exchange is not None and p.state is PartState.COMPLETE}
        lingering = []
        for task in self._tasks:
            if linger and id(task) in held and not task.done():
                task.get_loop().call_later(END_WAIT, task.cancel)
                lingering.append(task)
            else:
                task.cancel()
        if self.reducer is not None:
            self.reducer.close()
        return lingering


# -- recovering a lost part (Fetch) --------------------------------------------------------------

_FETCH_CODEC = get_codec(0)  # raw float32: exactly the values the holder applied


def holders(ar: ButterflyAllReduce, p: Part) -> list[int]:
    """Members that may hold part `p`: its reducer (its stream may have broken while it lives
    on), then every other server-mode member with tensors."""
    others = [
        i for i, m in enumerate(ar.group.members)
        if m.is_reducer and m.is_sender and i not in (ar.my_index, p.reducer)
    ]
    return [p.reducer, *others]

async def fetch_part(ar: ButterflyAllReduce, p: Part) -> None:
    candidates = holders(ar, p)
    if not candidates:
        if p.state is PartState.FAILED:
            ar.resolve(p, PartState.LOST, p.reason)
        return
    tasks = [asyncio.ensure_future(_fetch_from(ar, p, i)) for i in candidates]
    for t in tasks:
        # the holders that lose the race (or answer NotFound: their round is over) end after the
        # winner, unawaited: their outcome is retrieved here, not logged as "Task exception was
        # never retrieved" when they are collected
        t.add_done_callback(_retrieve)
    winner: torch.Tensor | None = None
    decision = b""
    header: averaging_pb2.ResultHeader | None = None
    try:
        for next_done in asyncio.as_completed(tasks):
            try:
                values, header = await next_done
                decision = header.decision
            except Exception as e:  # noqa: BLE001 - that holder does not have it
                logger.debug("fetch of part %d failed: %s", p.index, e)
                continue
            winner = values
            break
    finally:
        for t in tasks:
            t.cancel()
    if winner is None:
        if p.state is PartState.FAILED:
            ar.resolve(p, PartState.LOST, p.reason)
        return  # still streaming (stalled): the stream may yet complete before the deadline
    assert p.values is not None
    if ar.reducer is not None:
        await ar.reducer.slots_released.wait()
    p.values.copy_(winner)
    p.claim = header
    ar.resolve(p, PartState.COMPLETE, decision=decision)


def _retrieve(task: asyncio.Task[object]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("a fetch from a holder failed: %s", task.exception())


async def _fetch_from(ar: ButterflyAllReduce, p: Part, holder: int) -> tuple[torch.Tensor, averaging_pb2.ResultHeader]:
    loop = asyncio.get_running_loop()
    member = ar.group.members[holder]
    request = averaging_pb2.FetchRequest(prefix=ar.group.prefix, round_id=ar.group.round_id, part=p.index)
    channel = ar.peer.pool.get(member.addr)
    values = torch.empty(p.size, dtype=torch.float32)
    bounds = chunk_bounds(p.size, _FETCH_CODEC.chunk_numel(ar.config.chunk_bytes))
    header: averaging_pb2.ResultHeader | None = None
    i = 0
    async for message in channel.stream(FETCH, [request.SerializeToString()],
                                        timeout=max(0.01, ar.deadline - loop.time()), bulk=ar.config.bulk):
        if header is None:
            header = averaging_pb2.ResultHeader.FromString(message)
            continue
        a, b = bounds[i]
        _FETCH_CODEC.decode(message, values[a:b])
        i += 1
    if header is None or i != len(bounds):
        raise NotFound(f"member {member.peer_id[-8:]} sent part {p.index} incomplete")
    return values, header

async def serve_part(ar: ButterflyAllReduce, part: int) -> AsyncIterator[bytes]:
    """Streams part `part` as this member holds it (raw float32), waiting until it is resolved."""
    if not 0 <= part < len(ar.parts) or (not ar.me.is_sender and part != ar.my_part):
        raise NotFound(f"this member holds no part {part}")
    p = ar.parts[part]
    loop = asyncio.get_running_loop()
    remaining = max(0.0, ar.deadline - loop.time())
    try:
        if p.index == ar.my_part:
            assert ar.reducer is not None
            await asyncio.wait_for(ar.reducer.finished.wait(), remaining)
        else:
            await asyncio.wait_for(p.settled.wait(), remaining)
    except TimeoutError:
        raise NotFound(f"part {part} did not arrive here in time") from None
    if p.index == ar.my_part:
        assert ar.reducer is not None
        if ar.reducer.aborted or ar.reducer.decision is None:
            raise NotFound(f"part {part} was not averaged here")
        values, decision = ar.reducer.result(), ar.reducer.decision.to_bytes()
        claim = ar.reducer.claim_fields()
    else:
        if p.state is not PartState.COMPLETE or p.values is None:
            raise NotFound(f"this member does not hold part {part}")
        values, decision = p.values, p.decision
        claim = claim_fields_of(p.claim)
    yield averaging_pb2.ResultHeader(decision=decision, part=part, compression=0, **claim).SerializeToString()
    for a, b in chunk_bounds(p.size, _FETCH_CODEC.chunk_numel(ar.config.chunk_bytes)):
        yield _FETCH_CODEC.encode(values[a:b])



def claim_fields_of(header: averaging_pb2.ResultHeader | None) -> ClaimFields:
    """The robust and verification fields of a received `ResultHeader`, to pass on with a fetched part."""
    if header is None:
        return {}
    return {"clip_scales": list(header.clip_scales), "clip_tau": header.clip_tau, "clip_step": header.clip_step,
            "digest": header.digest, "sketches": list(header.sketches), "distances": list(header.distances)}
