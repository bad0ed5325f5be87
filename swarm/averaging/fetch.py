"""Recovering a part whose reducer died (or whose stream broke) while sending it back.

A member that lost part j asks the members that may hold it (its reducer first, then every other
server-mode member with tensors) over ``Fetch``; a holder answers once its own copy of the part
is settled, with the exact float32 values it holds and the decision's bytes. Holders keep a
round's results until every member closed its streams to them (see `averager._release`), so a
member that could not get a part from anyone knows that no one else applied the round either.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import torch

from swarm.averaging.partition import chunk_bounds
from swarm.averaging.parts import Part, PartState
from swarm.averaging.service import FETCH
from swarm.compression import get_codec
from swarm.core.errors import NotFound
from swarm.proto import averaging_pb2

if TYPE_CHECKING:
    from swarm.averaging.allreduce import ButterflyAllReduce

logger = logging.getLogger(__name__)

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
    winner: torch.Tensor | None = None
    decision = b""
    try:
        for next_done in asyncio.as_completed(tasks):
            try:
                values, decision = await next_done
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
    ar.resolve(p, PartState.COMPLETE, decision=decision)

async def _fetch_from(ar: ButterflyAllReduce, p: Part, holder: int) -> tuple[torch.Tensor, bytes]:
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
    return values, header.decision

async def serve_part(ar: ButterflyAllReduce, part: int) -> Any:
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
    else:
        if p.state is not PartState.COMPLETE or p.values is None:
            raise NotFound(f"this member does not hold part {part}")
        values, decision = p.values, p.decision
    yield averaging_pb2.ResultHeader(decision=decision, part=part, compression=0).SerializeToString()
    for a, b in chunk_bounds(p.size, _FETCH_CODEC.chunk_numel(ar.config.chunk_bytes)):
        yield _FETCH_CODEC.encode(values[a:b])

