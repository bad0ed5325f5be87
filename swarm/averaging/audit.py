"""A member's audit of a verified round: check every part it holds, report to the leader, obey the verdict.

Runs after the member holds every part under one decision and before it writes anything into its
tensors (`ButterflyAllReduce.run`). The checks are `verification.check_part`; the leader collects
every member's `VerifyReport` in a `verification.Verdict` and gives all of them the same answer,
so a reducer caught by any member fails the round for every member, named in `ReducerLied`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import torch

from swarm.averaging.agreement import Decision
from swarm.averaging.allreduce import ButterflyAllReduce
from swarm.averaging.partition import chunk_bounds
from swarm.averaging.parts import RoundFailed
from swarm.averaging.verification import PartClaim, ReducerLied, check_part
from swarm.proto import averaging_pb2

AskVerdict = Callable[[averaging_pb2.VerifyReport], Awaitable[averaging_pb2.VerifyVerdict]]


def _as_sent(ar: ButterflyAllReduce, values: torch.Tensor) -> torch.Tensor:
    """This member's input to a part as its reducer decoded it (the codec's round trip, chunk by chunk)."""
    if ar.codec.kind == 0:
        return values
    out = torch.empty_like(values)
    for a, b in chunk_bounds(values.numel(), ar.chunk_numel):
        ar.codec.decode(ar.codec.encode(values[a:b]), out[a:b])
    return out


def check_parts(ar: ButterflyAllReduce, decision: Decision) -> tuple[list[bytes], list[int], list[str]]:
    """(digest per part, accused reducers, reasons): this member's checks of every part it holds."""
    contributors = list(decision.contributors)
    robust = ar.config.robust
    digests: list[bytes] = []
    accused: list[int] = []
    reasons: list[str] = []
    for p in ar.parts:
        if p.index == ar.my_part:
            assert ar.reducer is not None and ar.reducer.claim is not None
            digests.append(ar.reducer.claim[0])
            continue
        assert p.values is not None and p.claim is not None  # a complete part came with its header
        try:
            claim = PartClaim.from_header(p.claim, len(contributors))
        except (ValueError, TypeError, RuntimeError) as e:
            digests.append(b"")
            accused.append(p.reducer)
            reasons.append(f"part {p.index}: malformed claim ({e})")
            continue
        digests.append(claim.digest)
        own = None
        if ar.my_index in contributors and ar.flat is not None and p.size:
            own = _as_sent(ar, ar.flat.read(p.start, p.start + p.size)).clone()
        reason = check_part(claim, p.values, own, ar.my_index, contributors, decision.weights,
                            ar.group.round_id, p.index, robust, ar.config.clip_tau, int(ar.codec.kind),
                            ar.config.clip_tau_scale, ar.chunk_numel)
        if reason:
            accused.append(p.reducer)
            reasons.append(f"part {p.index}: {reason}")
    return digests, accused, reasons


async def audit_round(ar: ButterflyAllReduce, decision: Decision, ask_verdict: AskVerdict) -> None:
    """Checks, reports, and raises `ReducerLied` (or `RoundFailed` without a verdict) unless all is well."""
    loop = asyncio.get_running_loop()
    digests, accused, reasons = await loop.run_in_executor(None, check_parts, ar, decision)
    report = averaging_pb2.VerifyReport(
        prefix=ar.group.prefix, round_id=ar.group.round_id, member=ar.my_index, digests=digests,
        accused=accused, reasons=reasons,
    )
    members = ar.group.members
    try:
        verdict = await asyncio.wait_for(ask_verdict(report), max(0.01, ar.deadline - loop.time()))
    except Exception as e:  # noqa: BLE001 - leader gone or slow: this member cannot know the verdict
        if accused:
            raise ReducerLied(ar.group.round_id, members[accused[0]].peer_id, ar.peer.peer_id, reasons[0]) from None
        raise RoundFailed(ar.group.round_id, f"no verdict from the leader ({type(e).__name__}: {e})") from None
    if accused:  # never apply what this member caught itself, whatever the leader says
        raise ReducerLied(ar.group.round_id, members[accused[0]].peer_id, ar.peer.peer_id, reasons[0])
    if not verdict.ok:
        if not 0 <= verdict.accused < len(members) or not 0 <= verdict.reported_by < len(members):
            raise RoundFailed(ar.group.round_id, f"the verdict names no member: {verdict.reason}")
        raise ReducerLied(ar.group.round_id, members[verdict.accused].peer_id,
                          members[verdict.reported_by].peer_id, verdict.reason)
