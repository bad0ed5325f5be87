"""The reducer of one part: receives every sender's part, averages it, streams the mean back.

Life of a part (see `agreement`): collect until every sender is done, stalled past
`sender_timeout`, or the report time; freeze (late chunks are ignored); report the complete and
finite senders to the leader and wait for its decision (long poll); average over the decision's
contributors; stream the mean back on every sender's stream, with the decision in the header.
Server-mode members get the last message of the part before client-mode members do, and only
once they acknowledged it: whoever holds a part can then always be reached by a member who lost
it (`allreduce` fetches lost parts from server-mode members only).

What the reducer receives (`PartCollector`, first in this file): every sender's chunks, into its
slot and a running sum. Pipelined: each ~1 MiB chunk is decoded into that sender's slot of the
part as it arrives and added (times the sender's weight) into a running sum, so reduction overlaps
the transfer. The slots let the reducer recompute the sum over exactly the agreed contributors
when the running sum holds someone else (a sender that died half-way, or sent NaN): the decision,
not the order of arrival, fixes what is in the mean. `PartReducer` builds on it with the report to
the leader, the average, and streaming the mean back.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from swarm.averaging.agreement import Decision, Report
from swarm.averaging.config import AllReduceConfig
from swarm.averaging.faults import FaultPoint
from swarm.averaging.group import GroupInfo
from swarm.averaging.partition import FlatTensors, chunk_bounds
from swarm.averaging.parts import ClaimFields
from swarm.averaging.robust import ClipOutcome, centered_clip, too_few
from swarm.averaging.verification import input_distances, part_digest, sketch
from swarm.compression import Codec, CompressionError, has_nonfinite
from swarm.compression.base import HEADER_SIZE, read_header
from swarm.core.errors import InvalidRequest
from swarm.core.faults import Action, FaultInjected, FaultPlan
from swarm.core.loop import spawn
from swarm.net.bulk import Sink, Sunk
from swarm.net.frames import Frames
from swarm.net.server import CallContext
from swarm.proto import averaging_pb2

if TYPE_CHECKING:
    import numpy

logger = logging.getLogger(__name__)

# Seconds at most that the leader's reducer holds its mean after deciding, until another reducer's
# mean starts to arrive here (`PartReducer.hold`). The leader knows the decision first; every other
# reducer learns it a one-way trip later or more. A leader that sent its mean at once filled its
# uplink with its own slow-starting flows just as the other reducers' flows to it began; in the
# network lab those flows lost the most packets of any and the leader got its last part 0.35-1.3 s
# after every other member in every 8-peer round timed (benchmarks/history/BENCHMARKS-2026-12-05.md, scenario 3, "The lagging
# member is the round's leader"). A round whose other reducers never answer waits this long at most.
LEADER_HOLD_CAP = 0.25


@dataclass
class _Sender:
    index: int
    weight: float
    has_data: bool = True
    slot: torch.Tensor | None = None
    complete: bool = False
    failed: str = ""
    added: bool = False
    streaming: bool = False
    acked: bool = False
    ended: bool = False       # its stream closed (cleanly: it is done with the round)
    broken: bool = False
    client_mode: bool = False
    last_progress: float = 0.0
    sink: Sink | None = None  # receives its chunks straight into its slot (bulk channel, NONE codec)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # acked, or its stream ended

    @property
    def done(self) -> bool:
        return self.complete or bool(self.failed)


class PartCollector:
    """Collects part `part` of the round's flat vector from its senders on this peer.

    Arguments as for `reducer.PartReducer`, which extends this class.
    """

    def __init__(
        self, group: GroupInfo, my_index: int, part: int, start: int, size: int, flat: FlatTensors | None,
        slots: torch.Tensor, accumulator: torch.Tensor, codec: Codec, config: AllReduceConfig, faults: FaultPlan,
        t0: float, timeout: float,
    ) -> None:
        self.group, self.my_index, self.part, self.offset, self.size = group, my_index, part, start, size
        self.flat, self.codec, self.config, self.faults = flat, codec, config, faults
        self.t0, self.timeout = t0, timeout
        self.chunks = chunk_bounds(size, codec.chunk_numel(config.chunk_bytes))
        self.sum = accumulator[:size]
        self.senders: dict[int, _Sender] = {}
        slot_index = 0
        for i in group.senders:
            member = group.members[i]
            sender = _Sender(i, member.weight, client_mode=member.client_mode, last_progress=t0)
            if i != my_index:
                sender.slot = slots[slot_index * size:(slot_index + 1) * size]
                slot_index += 1
            self.senders[i] = sender
        self.frozen = False
        # per sender index: how long it may stay silent once streaming (set by the all-reduce from
        # that peer's link estimates); absent: sender_timeout
        self.silence_limits: dict[int, float] = {}
        self.received_chunks = 0
        self._changed = asyncio.Event()
        self.streams_closed = asyncio.Event()  # every remote sender closed its stream cleanly
        self._acked = asyncio.Event()

    # -- collecting --------------------------------------------------------------------------

    async def _collect(self, loop: asyncio.AbstractEventLoop) -> None:
        """Waits until every sender is done, stalled, or the report time has come."""
        report_at = self.t0 + self.config.report_at * self.timeout
        while True:
            now = loop.time()
            pending = [s for s in self.senders.values() if not s.done]
            for s in pending:
                if now - s.last_progress >= self._silence_limit(s):
                    s.failed = "stalled" if s.streaming else "never connected"
            pending = [s for s in pending if not s.done]
            if not pending or now >= report_at:
                for s in pending:
                    s.failed = "too late"
                return
            wake = min([report_at] + [s.last_progress + self._silence_limit(s) for s in pending])
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.001, wake - now))
            except TimeoutError:
                pass

    def sender_gone(self, index: int) -> None:
        """Sender `index` is known dead (its address refused a connection): stop waiting for it."""
        sender = self.senders.get(index)
        if sender is not None and not sender.done and not self.frozen:
            sender.failed = "gone (connection refused)"
            self._changed.set()

    def _silence_limit(self, sender: _Sender) -> float:
        if not sender.streaming:  # connecting takes round trips of its own: the round-wide limit
            return self.config.sender_timeout
        return self.silence_limits.get(sender.index, self.config.sender_timeout)

    def _data_of(self, sender: _Sender) -> torch.Tensor:
        if sender.index == self.my_index:
            assert self.flat is not None
            return self.flat.read(self.offset, self.offset + self.size)
        assert sender.slot is not None
        return sender.slot

    def _make_report(self) -> Report:
        ok = {s.index for s in self.senders.values() if s.complete and s.has_data and s.weight > 0}
        failed = {s.index: s.failed for s in self.senders.values() if s.failed}
        if self.size and not math.isfinite(float(self.sum.sum())):
            # rare: find who sent NaN/inf (or values whose weighted sum overflows)
            for i in sorted(ok):
                if has_nonfinite(self._data_of(self.senders[i])):
                    ok.discard(i)
                    failed[i] = "non-finite values"
        return Report(self.part, frozenset(ok), failed)

    async def wait_acknowledged(self, timeout: float) -> bool:
        """Waits until every sender that streamed to us acknowledged our averaged part."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            if all(s.acked for s in self.senders.values() if s.index != self.my_index and s.streaming):
                return True
            if loop.time() >= end:
                return False
            self._acked.clear()
            try:
                await asyncio.wait_for(self._acked.wait(), max(0.001, end - loop.time()))
            except TimeoutError:
                pass

    # -- a sender's stream -------------------------------------------------------------------

    def _chooser(self, sender: _Sender) -> Callable[[int, int], tuple[bytearray, numpy.ndarray] | None]:
        """Where chunk messages of `sender` go on the bulk channel: straight into its slot (after a
        scratch buffer for the codec's header), while the part still collects."""

        def choose(index: int, length: int) -> tuple[bytearray, numpy.ndarray] | None:
            i = index - 1  # message 0 is the ReduceHeader
            if not 0 <= i < len(self.chunks) or self.frozen or sender.failed:
                return None
            a, b = self.chunks[i]
            if length != self.codec.encoded_size(b - a):
                return None
            assert sender.slot is not None
            return bytearray(HEADER_SIZE), sender.slot[a:b].view(torch.uint8).numpy()

        return choose

    def _detach_sinks(self) -> None:
        """From here on nothing more is received into the slots (they are about to hold results)."""
        for s in self.senders.values():
            if s.sink is not None:
                s.sink.detach()

    def _decode_chunk(self, sender: _Sender, message: bytes | Sunk, a: int, b: int) -> str | None:
        """Put one received chunk (`a:b` of the part) into the sender's slot; why it is refused, or None.

        A `Sunk` chunk is in the slot already (the stream wrote it there): only its header is checked."""
        if isinstance(message, Sunk):
            if message.dropped or not is_raw_float32(message.views[0], b - a):
                return "malformed chunk"
            return None
        if not message or message[0] != self.codec.kind:
            return _control_reason(message) or "malformed chunk"
        if len(message) != self.codec.encoded_size(b - a):
            return "malformed chunk"
        assert sender.slot is not None
        try:
            self.codec.decode(message, sender.slot[a:b])
        except (CompressionError, ValueError, TypeError) as e:
            return f"malformed chunk: {e}"
        return None

    async def _read(self, sender: _Sender, requests: AsyncIterator[bytes]) -> None:
        loop = asyncio.get_running_loop()
        it = requests.__aiter__()
        try:
            if sender.has_data:
                for a, b in self.chunks:
                    message = await it.__anext__()
                    if self.frozen or sender.failed:
                        continue  # reported already: late data is not in this round
                    refused = self._decode_chunk(sender, message, a, b)
                    if refused is not None:
                        sender.failed = refused
                        self._changed.set()
                        return
                    self.sum[a:b].add_(sender.slot[a:b], alpha=sender.weight)  # type: ignore[index]
                    sender.added = True
                    sender.last_progress = loop.time()
                    self.received_chunks += 1
                    await self.faults.hit(FaultPoint.AFTER_CHUNKS_RECEIVED, self.received_chunks)
            if not self.frozen and not sender.failed:
                sender.complete = True
                logger.debug("part %d: sender %d complete after %.3f s", self.part, sender.index, loop.time() - self.t0)
                self._changed.set()
            async for message in it:  # the acknowledgement, then the sender closes its side
                averaging_pb2.SenderAck.FromString(message)
                sender.acked = True
                sender.settled.set()
                self._acked.set()
            sender.ended = True
        except StopAsyncIteration:
            if not sender.done:
                sender.failed = "stream ended early"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken stream is an expected event
            if not sender.done:
                sender.failed = f"stream broken ({type(e).__name__})"
            sender.broken = isinstance(e, FaultInjected)
        finally:
            sender.settled.set()
            self._changed.set()
            if all(s.ended for s in self.senders.values() if s.index != self.my_index):
                self.streams_closed.set()


def is_raw_float32(header: memoryview | bytes, numel: int) -> bool:
    """Whether a received codec header announces `numel` float32 values without compression."""
    try:
        parsed = read_header(bytes(header))
    except CompressionError:
        return False
    return parsed.kind == 0 and parsed.dtype == torch.float32 and parsed.numel == numel


def _control_reason(message: bytes) -> str:
    try:
        ack = averaging_pb2.SenderAck.FromString(message)
    except Exception:  # noqa: BLE001
        return ""
    return ack.reason


def encode_failure_message(part: int, reason: str) -> bytes:
    """What a sender puts on its stream instead of a chunk it cannot encode (NaN under a lossy codec)."""
    return averaging_pb2.SenderAck(part=part, reason=reason).SerializeToString()


__all__ = ["PartReducer", "ReportFn", "encode_failure_message", "is_raw_float32"]

ReportFn = Callable[[Report], Awaitable[Decision]]


class PartReducer(PartCollector):
    """Reduces part `part` of the round's flat vector on this peer.

    Args:
        group: the round's group.
        my_index: this peer's index in the group.
        start: offset of the part in the flat vector; `size` its length.
        flat: this member's own tensors (None for auxiliary members).
        slots: a float32 buffer of at least (number of remote senders) * size elements.
        accumulator: a float32 buffer of `size` elements for the running sum, then the mean.
        codec: the wire codec.
        config: timeouts.
        faults: fault plan.
        t0: loop time when the round started here; `timeout` its length in seconds.
        report: sends a report to the leader and returns its decision.
    """

    def __init__(
        self, group: GroupInfo, my_index: int, part: int, start: int, size: int, flat: FlatTensors | None,
        slots: torch.Tensor, accumulator: torch.Tensor, codec: Codec, config: AllReduceConfig, faults: FaultPlan,
        t0: float,
        timeout: float, report: ReportFn,
    ) -> None:
        super().__init__(group, my_index, part, start, size, flat, slots, accumulator, codec, config, faults,
                         t0, timeout)
        self._report = report
        self.clip: ClipOutcome | None = None                  # robust mode: CenteredClip's outcome
        self.claim: tuple[bytes, list[float], list[float]] | None = None  # verified: digest, input sketches, distances
        self.sent_chunks = 0
        self.decision: Decision | None = None
        self.abort_reason = ""
        self.finished = asyncio.Event()        # mean ready, or aborted
        # the leader's: set once another reducer's mean starts to arrive here (its mean waits for it)
        self.hold: asyncio.Event | None = None
        self.slots_released = asyncio.Event()  # the slots may now hold this member's results
        self._payloads: list[bytes | None] = []
        self._task: asyncio.Task[None] | None = None
        self._streams: list[asyncio.Task[None]] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        me = self.senders.get(self.my_index)
        if me is not None and self.flat is not None and me.weight > 0 and self.size:
            torch.mul(self.flat.read(self.offset, self.offset + self.size), me.weight, out=self.sum)
            me.added = True
        else:
            self.sum.zero_()
        if me is not None:
            me.has_data = me.weight > 0
            me.complete = True
            me.settled.set()
        if all(i == self.my_index for i in self.senders):
            self.streams_closed.set()
        self._task = spawn(self._run(), name=f"avg-reduce-{self.group.round_id.hex()[:8]}-p{self.part}")

    @property
    def aborted(self) -> bool:
        return bool(self.abort_reason)

    def close(self) -> None:
        self._detach_sinks()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for task in self._streams:
            task.cancel()
        if not self.finished.is_set():
            self._abort("the peer is shutting down")

    def _abort(self, reason: str) -> None:
        self._detach_sinks()
        if not self.finished.is_set():
            self.abort_reason = reason or "aborted"
            self.finished.set()
            self.slots_released.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self._collect(loop)
            self.frozen = True
            self._detach_sinks()
            report = self._make_report()
            logger.debug("part %d: reporting after %.3f s", self.part, loop.time() - self.t0)
            await self.faults.hit(FaultPoint.BEFORE_REPORT)
            give_up = self.t0 + self.config.give_up_decision * self.timeout
            try:
                decision = await asyncio.wait_for(self._report(report), max(0.01, give_up - loop.time()))
            except TimeoutError:
                self._abort(f"part {self.part}: no decision from the leader in time")
                return
            except Exception as e:  # noqa: BLE001 - leader unreachable: this part cannot finish
                self._abort(f"part {self.part}: leader unreachable ({type(e).__name__}: {e})")
                return
            if decision.abort:
                self._abort(decision.reason)
                return
            if self.config.robust and too_few(len(decision.contributors)):
                # every reducer refuses the same decision alike, before sending anything
                self._abort(too_few(len(decision.contributors)))
                return
            logger.debug("part %d: decided after %.3f s", self.part, loop.time() - self.t0)
            await self._average(decision)
            logger.debug("part %d: averaged after %.3f s", self.part, loop.time() - self.t0)
            await self.faults.hit(FaultPoint.BEFORE_ALL_GATHER)
            if self.hold is not None and LEADER_HOLD_CAP > 0:
                try:
                    await asyncio.wait_for(self.hold.wait(), LEADER_HOLD_CAP)
                except TimeoutError:
                    pass
                logger.debug("part %d: the leader's mean goes out after %.3f s", self.part, loop.time() - self.t0)
            self.decision = decision
            self.finished.set()
        except asyncio.CancelledError:
            self._abort("cancelled")
            raise
        except Exception as e:
            logger.debug("reducer of part %d failed", self.part, exc_info=True)
            self._abort(f"part {self.part}: reducer failed ({type(e).__name__}: {e})")
            if not isinstance(e, ConnectionError):
                raise

    async def _average(self, decision: Decision) -> None:
        contributors = set(decision.contributors)
        added = {s.index for s in self.senders.values() if s.added}
        fast = added == contributors and all(self.senders[i].complete for i in contributors)
        weights = dict(zip(decision.contributors, decision.weights))
        total = decision.total_weight

        def compute() -> None:
            if self.config.robust:
                self.clip = combine_robust(self, decision)
                return
            if not fast:
                self.sum.zero_()
                for i in sorted(contributors):
                    self.sum.add_(self._data_of(self.senders[i]), alpha=weights[i])
            self.sum.div_(total)

        loop = asyncio.get_running_loop()
        if self.size or self.config.robust:
            await loop.run_in_executor(None, compute)
        lie = self.faults.take(FaultPoint.BEFORE_ALL_GATHER, Action.LIE)
        if lie is not None:
            self.sum.add_(lie.seconds)  # tests: a reducer that sends what it did not compute
        if not self.config.verified:
            self.slots_released.set()  # on the loop: asyncio events are not thread-safe
        if self.codec.kind != 0:
            # lossy codec: encode once, and keep what the others will decode as our own copy
            def encode_all() -> list[bytes | None]:
                out: list[bytes | None] = []
                for a, b in self.chunks:
                    payload = self.codec.encode(self.sum[a:b])
                    self.codec.decode(payload, self.sum[a:b])
                    out.append(payload)
                return out

            self._payloads = await loop.run_in_executor(None, encode_all)
        if self.config.verified:
            # the inputs' sketches need the slots: only then may they hold this member's results
            self.claim = await loop.run_in_executor(None, lambda: publish_claim(self, decision))
            self.slots_released.set()

    def claim_fields(self) -> ClaimFields:
        """The robust and verification fields of this part's `ResultHeader` (none in plain mode)."""
        fields: ClaimFields = {}
        if self.clip is not None:
            fields["clip_scales"], fields["clip_tau"], fields["clip_step"] = self.clip.scales, self.clip.tau, self.clip.step
        if self.claim is not None:
            fields["digest"], fields["sketches"], fields["distances"] = self.claim
        return fields

    def stream_tasks(self) -> list[asyncio.Task[None]]:
        """The readers of the senders' streams (done once each sender closed its side)."""
        return list(self._streams)

    def result(self) -> torch.Tensor:
        """The averaged part (valid once `finished` is set and not aborted)."""
        return self.sum

    def _payload(self, i: int) -> Frames:
        """Chunk `i` of the mean as sent: views of it (NONE, fixed until the round is released), or
        the payload encoded once for every stream (lossy codecs)."""
        a, b = self.chunks[i]
        if self.codec.kind == 0:
            return self.codec.encode_views(self.sum[a:b])
        payload = self._payloads[i]
        if payload is None:  # not reached: lossy payloads are all encoded before the first is sent
            payload = self._payloads[i] = self.codec.encode(self.sum[a:b])
        return payload

    # -- a sender's stream -------------------------------------------------------------------

    async def rpc_reduce(
        self, header: averaging_pb2.ReduceHeader, requests: AsyncIterator[bytes], ctx: CallContext
    ) -> AsyncIterator[Frames]:
        """Serves one sender's stream: reads its part, then yields the result header and chunks."""
        sender = self._admit(header, ctx)
        loop = asyncio.get_running_loop()
        sender.last_progress = loop.time()
        reader = spawn(self._read(sender, requests), name=f"avg-read-p{self.part}-s{header.sender}")
        self._streams.append(reader)
        deadline = self.t0 + self.timeout
        if not await self._outcome_known(sender, reader, deadline):
            return
        if self.aborted:
            yield averaging_pb2.ResultHeader(abort=True, reason=self.abort_reason, part=self.part).SerializeToString()
            return
        assert self.decision is not None
        result_header = averaging_pb2.ResultHeader(
            decision=self.decision.to_bytes(), part=self.part, compression=int(self.codec.kind), **self.claim_fields(),
        ).SerializeToString()
        n = len(self.chunks)
        if n == 0 and sender.client_mode:
            await self._wait_server_acks(deadline)
        yield result_header
        logger.debug("part %d: result to sender %d starts after %.3f s", self.part, header.sender, loop.time() - self.t0)
        for i in range(n):
            if i == n - 1 and sender.client_mode:
                await self._wait_server_acks(deadline)
            if sender.broken:
                raise FaultInjected(f"stream from member {header.sender} dropped")
            yield self._payload(i)
            self.sent_chunks += 1
            await self.faults.hit(FaultPoint.DURING_ALL_GATHER, self.sent_chunks)
        logger.debug("part %d: result to sender %d queued after %.3f s", self.part, header.sender, loop.time() - self.t0)
        # keep the call open until the sender holds every part and closes its side
        await asyncio.wait({reader}, timeout=max(0.0, deadline + self.config.linger - loop.time()))

    def _admit(self, header: averaging_pb2.ReduceHeader, ctx: CallContext) -> _Sender:
        """The sender a stream's header names, checked against the caller and this part, marked as
        streaming (its chunks land in its slot directly where the codec allows)."""
        sender = self.senders.get(header.sender)
        if sender is None or header.sender == self.my_index:
            raise InvalidRequest(f"member {header.sender} does not send to this reducer")
        if self.group.members[header.sender].peer_id != ctx.peer_id:
            raise InvalidRequest("the stream's sender index does not match the caller")
        if header.part != self.part or header.numel != self.size:
            raise InvalidRequest(f"part {header.part} of {header.numel} does not match part {self.part} of {self.size}")
        if sender.streaming:
            raise InvalidRequest("a second stream from the same sender")
        sender.streaming = True
        sender.has_data = header.has_data and sender.weight > 0
        if sender.has_data and self.codec.kind == 0 and sender.slot is not None:
            sender.sink = Sink(self._chooser(sender))
            ctx.receive_into(sender.sink)
        return sender

    async def _outcome_known(self, sender: _Sender, reader: asyncio.Task[None], deadline: float) -> bool:
        """Wait until the part's outcome is known (`finished`): False where the deadline comes first."""
        loop = asyncio.get_running_loop()
        finished = asyncio.ensure_future(self.finished.wait())
        try:
            while not finished.done():
                await asyncio.wait({finished, reader}, timeout=max(0.0, deadline - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if sender.broken:
                    raise FaultInjected(f"stream from member {sender.index} dropped")
                if loop.time() >= deadline:
                    return False
                if reader.done():  # the sender closed its side: wait for the outcome only
                    await asyncio.wait({finished}, timeout=max(0.0, deadline - loop.time()))
                    if not finished.done():
                        return False
        finally:
            finished.cancel()
        return True

    async def _wait_server_acks(self, deadline: float) -> None:
        """Before a client-mode member may complete the part, every server-mode sender acknowledged
        it (or dropped out), so a member that lost the part can fetch it from a server-mode one."""
        loop = asyncio.get_running_loop()
        waits = [s.settled.wait() for s in self.senders.values() if not s.client_mode and s.streaming]
        if not waits:
            return
        limit = min(deadline, loop.time() + self.config.sender_timeout) - loop.time()
        try:
            await asyncio.wait_for(asyncio.gather(*waits), max(0.0, limit))
        except TimeoutError:
            logger.debug("part %d: a server-mode member did not acknowledge in time", self.part)



# -- the robust combination and the verification claim (robust mode / verified rounds) -----------

def combine_robust(reducer: PartReducer, decision: Decision) -> ClipOutcome:
    """CenteredClip of the decision's contributors' chunks of this part into the reducer's sum.
    Runs once every chunk is in (the clip needs whole parts); the inputs stay in their slots."""
    order = list(decision.contributors)
    inputs = [reducer._data_of(reducer.senders[i]) for i in order]
    cfg = reducer.config
    return centered_clip(
        inputs, list(decision.weights), reducer.sum, tau=cfg.clip_tau, tau_scale=cfg.clip_tau_scale,
        max_iterations=cfg.clip_iterations, tolerance=cfg.clip_tolerance,
    )


def publish_claim(reducer: PartReducer, decision: Decision) -> tuple[bytes, list[float], list[float]]:
    """The digest of the part's result (as sent), the sketches of each contributor's input as
    received, and each input's distance from the result as sent."""
    digest = part_digest(reducer.sum)
    inputs = [reducer._data_of(reducer.senders[i]) for i in decision.contributors]
    sketches = sketch(inputs, reducer.group.round_id, reducer.part, digest)
    return digest, sketches.view(-1).tolist(), input_distances(inputs, reducer.sum)
