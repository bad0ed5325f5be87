"""The averaging RPCs of one peer, routed to the round (or averager) they are for.

One `AveragingService` per peer hosts, for every averager on it (keyed by prefix):

- ``Reduce``  (bidi stream): a sender's part in, the averaged part out (`reducer`);
- ``Report``  (unary, long poll): a reducer's report in, the leader's decision out (`agreement`);
- ``Fetch``   (server stream): a member that lost a part gets it from one that holds it;
- ``Verify``  (unary, long poll): verified rounds: a member's audit in, the leader's verdict out (`verification`);
- ``Join``    (unary, long poll): matchmaking (`matchmaking`);
- ``State``   (server stream): state transfer to newcomers (`state`).

Every averaging call counts against `AVERAGING_LIMIT` (`swarm.net.limits`): a stranger that opens
streams and sends nothing, or long polls it never needs, holds at most that many of this peer's
calls per source network and per caller, and is refused beyond it while other peers are served.

A stream for a round this peer has not registered yet (its own copy of the group is still on
the way) waits for it a little; a finished round answers NOT_FOUND at once.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from swarm.averaging.agreement import Coordinator, Report
from swarm.averaging.group import GroupInfo
from swarm.averaging.reducer import PartReducer
from swarm.averaging.verification import Verdict
from swarm.core.collector import freeze_long_lived
from swarm.core.errors import InvalidRequest, NotFound
from swarm.core.malloc import tune_malloc
from swarm.net.frames import Frames
from swarm.net.handle import NetworkHandle
from swarm.net.limits import CallLimit
from swarm.net.server import CallContext
from swarm.proto import averaging_pb2

REDUCE = "/swarm.Averaging/Reduce"
REPORT = "/swarm.Averaging/Report"
FETCH = "/swarm.Averaging/Fetch"
JOIN = "/swarm.Averaging/Join"
STATE = "/swarm.Averaging/State"
VERIFY = "/swarm.Averaging/Verify"

AVERAGING_LIMIT = CallLimit("averaging calls", per_source=128, per_caller=32)
"""Averaging calls in flight at once from one source network and from one caller: a member
holds a few per round (a Reduce stream per reducer, a Report, a Join), so honest groups stay far below."""

class RoundMember(Protocol):
    """This peer's side of one round, as the handlers need it (a `ButterflyAllReduce`)."""

    @property
    def group(self) -> GroupInfo: ...
    @property
    def reducer(self) -> PartReducer | None:
        """The reducer of this member's part; None for a member that reduces none (client mode)."""
        ...

    def serve_fetch(self, part: int) -> AsyncIterator[bytes]:
        """Streams part `part` as this member holds it, to a member that lost it."""
        ...


@dataclass
class RoundEntry:
    """What this peer runs for one round: its member side (with its reducer) and, if it leads, the coordinator."""

    allreduce: RoundMember
    coordinator: Coordinator | None = None
    verdict: Verdict | None = None  # verified rounds this peer leads


class AveragingService:
    """Routes averaging RPCs on one peer. Get it with `AveragingService.of(peer)`."""

    def __init__(self, peer: NetworkHandle, join_grace: float = 5.0, limit: CallLimit = AVERAGING_LIMIT) -> None:
        tune_malloc()  # this peer moves tensors from now on
        freeze_long_lived()  # and its rounds have deadlines: no full collection over its imports
        self.peer = peer
        self.join_grace = join_grace
        self.rounds: dict[tuple[str, bytes], RoundEntry] = {}
        self._waiters: dict[tuple[str, bytes], asyncio.Future[RoundEntry]] = {}
        self._finished: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self.join_handlers: dict[str, Callable[[averaging_pb2.JoinRequest, CallContext], Awaitable[averaging_pb2.JoinResponse]]] = {}
        self.state_handlers: dict[str, Callable[[averaging_pb2.StateRequest, CallContext], AsyncIterator[bytes]]] = {}
        server = peer.server
        if server is not None:
            server.add_stream(REDUCE, self.rpc_reduce, bulk=True, limit=limit)
            server.add_unary(REPORT, self.rpc_report, averaging_pb2.ReduceReport, limit=limit)
            server.add_stream(FETCH, self.rpc_fetch, request_streaming=False, bulk=True, limit=limit)
            server.add_unary(JOIN, self.rpc_join, averaging_pb2.JoinRequest, limit=limit)
            server.add_stream(STATE, self.rpc_state, request_streaming=False, bulk=True, limit=limit)
            server.add_unary(VERIFY, self.rpc_verify, averaging_pb2.VerifyReport, limit=limit)

    @classmethod
    def of(cls, peer: NetworkHandle) -> AveragingService:
        """The peer's service (kept in `peer.services`), created and its RPCs registered on first use."""
        return peer.services.get_or_create(cls, lambda: cls(peer))

    # -- round registry ----------------------------------------------------------------------

    def register(self, prefix: str, round_id: bytes, entry: RoundEntry) -> None:
        key = (prefix, round_id)
        self.rounds[key] = entry
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(entry)

    def unregister(self, prefix: str, round_id: bytes) -> None:
        key = (prefix, round_id)
        self.rounds.pop(key, None)
        self._finished[key] = None
        while len(self._finished) > 1024:
            self._finished.popitem(last=False)
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(NotFound("round finished"))

    async def _entry(self, prefix: str, round_id: bytes, ctx: CallContext) -> RoundEntry:
        key = (prefix, round_id)
        entry = self.rounds.get(key)
        if entry is not None:
            return entry
        if key in self._finished:
            raise NotFound(f"round {round_id.hex()[:12]} of {prefix!r} is over here")
        waiter = self._waiters.get(key)
        if waiter is None:
            waiter = self._waiters[key] = asyncio.get_running_loop().create_future()
        remaining = ctx.time_remaining()
        limit = self.join_grace if remaining is None else min(self.join_grace, remaining)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), limit)
        except TimeoutError:
            if self._waiters.get(key) is waiter and not waiter.done():
                del self._waiters[key]  # nobody registered it: forget (a later caller waits anew)
                waiter.cancel()
            raise NotFound(f"round {round_id.hex()[:12]} of {prefix!r} is unknown here") from None

    # -- handlers ------------------------------------------------------------------------------

    async def rpc_reduce(self, requests: AsyncIterator[bytes], ctx: CallContext) -> AsyncIterator[Frames]:
        it = requests.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise InvalidRequest("empty Reduce stream") from None
        header = averaging_pb2.ReduceHeader.FromString(first)
        entry = await self._entry(header.prefix, header.round_id, ctx)
        reducer = entry.allreduce.reducer
        if reducer is None:
            raise InvalidRequest("this member reduces no part (client mode)")
        async for message in reducer.rpc_reduce(header, it, ctx):
            yield message

    async def rpc_report(self, request: averaging_pb2.ReduceReport, ctx: CallContext) -> bytes:
        entry = await self._entry(request.prefix, request.round_id, ctx)
        coordinator = entry.coordinator
        if coordinator is None:
            raise InvalidRequest("this peer does not lead that round")
        group = coordinator.group
        expected = group.members[group.reducers[request.part]].peer_id if 0 <= request.part < len(group.reducers) else None
        if expected != ctx.peer_id:
            raise InvalidRequest("only a part's reducer may report on it")
        decision = await coordinator.submit(Report.from_proto(request))
        return decision.to_bytes()

    async def rpc_verify(self, request: averaging_pb2.VerifyReport, ctx: CallContext) -> averaging_pb2.VerifyVerdict:
        entry = await self._entry(request.prefix, request.round_id, ctx)
        verdict = entry.verdict
        if verdict is None:
            raise InvalidRequest("this peer does not lead a verified round of that id")
        members = verdict.group.members
        if not 0 <= request.member < len(members) or members[request.member].peer_id != ctx.peer_id:
            raise InvalidRequest("a member reports only for itself")
        return await verdict.submit(request)

    async def rpc_fetch(self, requests: AsyncIterator[bytes], ctx: CallContext) -> AsyncIterator[bytes]:
        request = None
        async for message in requests:
            request = averaging_pb2.FetchRequest.FromString(message)
        if request is None:
            raise InvalidRequest("empty Fetch request")
        entry = await self._entry(request.prefix, request.round_id, ctx)
        group = entry.allreduce.group
        if ctx.peer_id not in group.peer_ids:
            raise InvalidRequest("only members of a round may fetch its parts")
        async for message in entry.allreduce.serve_fetch(request.part):
            yield message

    async def rpc_join(self, request: averaging_pb2.JoinRequest, ctx: CallContext) -> averaging_pb2.JoinResponse:
        handler = self.join_handlers.get(request.prefix)
        if handler is None:
            return averaging_pb2.JoinResponse(accepted=False, reason=f"no averager for {request.prefix!r} here")
        return await handler(request, ctx)

    async def rpc_state(self, requests: AsyncIterator[bytes], ctx: CallContext) -> AsyncIterator[bytes]:
        request = None
        async for message in requests:
            request = averaging_pb2.StateRequest.FromString(message)
        if request is None:
            raise InvalidRequest("empty State request")
        handler = self.state_handlers.get(request.prefix)
        if handler is None:
            raise NotFound(f"no state for {request.prefix!r} here")
        async for message in handler(request, ctx):
            yield message
