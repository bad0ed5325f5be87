"""The reducer of one part: receives every sender's part, averages it, streams the mean back.

Receiving (each chunk decoded into its sender's slot and added into a running sum as it
arrives) is `collector.PartCollector`, which `PartReducer` extends.

Life of a part (see `agreement`): collect until every sender is done, stalled past
`sender_timeout`, or the report time; freeze (late chunks are ignored); report the complete and
finite senders to the leader and wait for its decision (long poll); average over the decision's
contributors; stream the mean back on every sender's stream, with the decision in the header.
Server-mode members get the last message of the part before client-mode members do, and only
once they acknowledged it: whoever holds a part can then always be reached by a member who lost
it (`allreduce` fetches lost parts from server-mode members only).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import torch

from swarm.averaging.agreement import Decision, Report
from swarm.averaging.collector import PartCollector, encode_failure_message, is_raw_float32
from swarm.averaging.config import AllReduceConfig
from swarm.averaging.faults import FaultInjected, FaultPlan, FaultPoint
from swarm.averaging.group import GroupInfo
from swarm.averaging.partition import FlatTensors
from swarm.compression import Codec
from swarm.core.errors import InvalidRequest
from swarm.core.loop import spawn
from swarm.net.bulk import Sink
from swarm.net.server import CallContext
from swarm.proto import averaging_pb2

# encode_failure_message and is_raw_float32 live in `collector`; `allreduce` imports them from here
__all__ = ["PartReducer", "ReportFn", "encode_failure_message", "is_raw_float32"]

logger = logging.getLogger(__name__)

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
        self.sent_chunks = 0
        self.decision: Decision | None = None
        self.abort_reason = ""
        self.finished = asyncio.Event()        # mean ready, or aborted
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
            logger.debug("part %d: decided after %.3f s", self.part, loop.time() - self.t0)
            await self._average(decision)
            logger.debug("part %d: averaged after %.3f s", self.part, loop.time() - self.t0)
            await self.faults.hit(FaultPoint.BEFORE_ALL_GATHER)
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
            if not fast:
                self.sum.zero_()
                for i in sorted(contributors):
                    self.sum.add_(self._data_of(self.senders[i]), alpha=weights[i])
            self.sum.div_(total)

        loop = asyncio.get_running_loop()
        if self.size:
            await loop.run_in_executor(None, compute)
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

    def stream_tasks(self) -> list[asyncio.Task[None]]:
        """The readers of the senders' streams (done once each sender closed its side)."""
        return list(self._streams)

    def result(self) -> torch.Tensor:
        """The averaged part (valid once `finished` is set and not aborted)."""
        return self.sum

    def _payload(self, i: int) -> Any:
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
    ) -> AsyncIterator[bytes]:
        """Serves one sender's stream: reads its part, then yields the result header and chunks."""
        caller = ctx.peer_id
        sender = self.senders.get(header.sender)
        if sender is None or header.sender == self.my_index:
            raise InvalidRequest(f"member {header.sender} does not send to this reducer")
        if self.group.members[header.sender].peer_id != caller:
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
        loop = asyncio.get_running_loop()
        sender.last_progress = loop.time()
        reader = spawn(self._read(sender, requests), name=f"avg-read-p{self.part}-s{header.sender}")
        self._streams.append(reader)
        deadline = self.t0 + self.timeout
        finished = asyncio.ensure_future(self.finished.wait())
        try:
            while not finished.done():
                await asyncio.wait({finished, reader}, timeout=max(0.0, deadline - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if sender.broken:
                    raise FaultInjected(f"stream from member {header.sender} dropped")
                if loop.time() >= deadline:
                    return
                if reader.done():  # the sender closed its side: wait for the outcome only
                    await asyncio.wait({finished}, timeout=max(0.0, deadline - loop.time()))
                    if not finished.done():
                        return
        finally:
            finished.cancel()
        if self.aborted:
            yield averaging_pb2.ResultHeader(abort=True, reason=self.abort_reason, part=self.part).SerializeToString()
            return
        assert self.decision is not None
        result_header = averaging_pb2.ResultHeader(
            decision=self.decision.to_bytes(), part=self.part, compression=int(self.codec.kind)
        ).SerializeToString()
        n = len(self.chunks)
        if n == 0 and sender.client_mode:
            await self._wait_server_acks(deadline)
        yield result_header
        for i in range(n):
            if i == n - 1 and sender.client_mode:
                await self._wait_server_acks(deadline)
            if sender.broken:
                raise FaultInjected(f"stream from member {header.sender} dropped")
            yield self._payload(i)
            self.sent_chunks += 1
            await self.faults.hit(FaultPoint.DURING_ALL_GATHER, self.sent_chunks)
        # keep the call open until the sender holds every part and closes its side
        await asyncio.wait({reader}, timeout=max(0.0, deadline + self.config.linger - loop.time()))

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

