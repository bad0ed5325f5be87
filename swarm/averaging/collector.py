"""What the reducer of one part receives: every sender's chunks, into its slot and a running sum.

Pipelined: each ~1 MiB chunk is decoded into that sender's slot of the part as it arrives and
added (times the sender's weight) into a running sum, so reduction overlaps the transfer. The
slots let the reducer recompute the sum over exactly the agreed contributors when the running
sum holds someone else (a sender that died half-way, or sent NaN): the decision, not the order
of arrival, fixes what is in the mean.

`PartCollector` holds that receiving state and reads the senders' streams; `reducer.PartReducer`
builds on it with the report to the leader, the average, and streaming the mean back.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.averaging.agreement import Report
from swarm.averaging.config import AllReduceConfig
from swarm.averaging.faults import FaultInjected, FaultPlan, FaultPoint
from swarm.averaging.group import GroupInfo
from swarm.averaging.partition import FlatTensors, chunk_bounds
from swarm.compression import Codec, CompressionError, has_nonfinite
from swarm.compression.base import HEADER_SIZE, read_header
from swarm.net.bulk import Sink, Sunk
from swarm.proto import averaging_pb2


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
                if now - s.last_progress >= self.config.sender_timeout:
                    s.failed = "stalled" if s.streaming else "never connected"
            pending = [s for s in pending if not s.done]
            if not pending or now >= report_at:
                for s in pending:
                    s.failed = "too late"
                return
            wake = min([report_at] + [s.last_progress + self.config.sender_timeout for s in pending])
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.001, wake - now))
            except TimeoutError:
                pass

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

    def _chooser(self, sender: _Sender) -> Any:
        """Where chunk messages of `sender` go on the bulk channel: straight into its slot (after a
        scratch buffer for the codec's header), while the part still collects."""

        def choose(index: int, length: int) -> tuple[bytearray, Any] | None:
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

    async def _read(self, sender: _Sender, requests: AsyncIterator[bytes]) -> None:
        loop = asyncio.get_running_loop()
        it = requests.__aiter__()
        try:
            if sender.has_data:
                for a, b in self.chunks:
                    message = await it.__anext__()
                    if self.frozen or sender.failed:
                        continue  # reported already: late data is not in this round
                    if isinstance(message, Sunk):  # already in the slot: check what the header says
                        if message.dropped or not is_raw_float32(message.views[0], b - a):
                            sender.failed = "malformed chunk"
                            self._changed.set()
                            return
                        self.sum[a:b].add_(sender.slot[a:b], alpha=sender.weight)  # type: ignore[index]
                        sender.added = True
                        sender.last_progress = loop.time()
                        self.received_chunks += 1
                        await self.faults.hit(FaultPoint.AFTER_CHUNKS_RECEIVED, self.received_chunks)
                        continue
                    if not message or message[0] != self.codec.kind:
                        sender.failed = _control_reason(message) or "malformed chunk"
                        self._changed.set()
                        return
                    if len(message) != self.codec.encoded_size(b - a):
                        sender.failed = "malformed chunk"
                        self._changed.set()
                        return
                    assert sender.slot is not None
                    slot = sender.slot[a:b]
                    try:
                        self.codec.decode(message, slot)
                    except (CompressionError, ValueError, TypeError) as e:
                        sender.failed = f"malformed chunk: {e}"
                        self._changed.set()
                        return
                    self.sum[a:b].add_(slot, alpha=sender.weight)
                    sender.added = True
                    sender.last_progress = loop.time()
                    self.received_chunks += 1
                    await self.faults.hit(FaultPoint.AFTER_CHUNKS_RECEIVED, self.received_chunks)
            if not self.frozen and not sender.failed:
                sender.complete = True
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


def is_raw_float32(header: Any, numel: int) -> bool:
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
