"""Spot checks: a sampled fraction of a mixture's batches also sent to a second server of the same expert.

The answer checks (`swarm.moe.client.answer_checks`) catch answers that are not finite, of another
shape or far too large; they cannot see an answer of honest size that is simply wrong (negated,
computed by another model). Where an expert is served by several servers (replicas, found with
`ExpertSource.get_replicas`), a mixture can ask a second one for the same rows and compare. Off by
default (`SpotCheckConfig.fraction` = 0): each spot-checked batch costs one more forward per
expert that has a replica, sent at the same time as the batch's own calls; once those are done, the
second opinions get at most `SpotCheckConfig.opinion_share` of the forward timeout more.

Two answers match when, in every row, their difference is at most `tolerance` times the larger of
their norms (floored at the answer's median row norm). A mismatch is evidence that one of the two
servers lies, not which:

- a second opinion that is not finite or not of the answer's shape blames its own server at once;
- else, if a third server of the expert exists, it is asked too (the third opinions of all of a
  batch's mismatches at once, under one deadline: `SpotCheckConfig.opinion_share` of the
  forward timeout), and the server it contradicts is blamed;
- else (no third server, or it gave no answer, or agreed with neither) the servers' mismatches
  accumulate: a server that mismatched with `SpotCheckConfig.evidence_partners` distinct servers
  (two by default) over such undecided mismatches is blamed, and its record starts afresh;
- otherwise nobody is blamed and the answer the batch got stands (it passed the answer checks): one
  liar must not be able to get an honest server avoided, or an expert left out, by contradicting it.

A blamed server is avoided for `AnswerChecks.avoid_for` seconds like the server of a rejected answer
(and, when it is the one the batch used, its answer is dropped: the expert fails for the batch,
`k_min` decides). A second or third server that gave no answer in time is avoided like a server that
timed out (`SilentReplica`, for `DispatchPolicy.exclude_failed_for` seconds), so it stalls no more
batches for that long.

Every mismatch is logged (WARNING) and counted in ``swarm_moe_rejected_answers_total`` with
reason ``mismatch``; `SpotChecker.evidence` holds, per server, the mismatches it was part of, and
`SpotChecker.blamed_on_evidence` the servers blamed on accumulated evidence.

Replicas are compared on their forward outputs, so they must hold the same parameters, within
`tolerance`: experts that are frozen, or whose servers average their parameters. Replicas that
train apart drift, and then mismatch.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from swarm.core.errors import ConfigError, MoEError
from swarm.dht.handle import PeerHandle
from swarm.moe.client.answer_checks import MisbehavingExpert, count_event
from swarm.moe.magnitudes import row_norms, typical_norm
from swarm.moe.protocol import call_forward_keeping
from swarm.moe.sources import ExpertSource

__all__ = ["ReplicaMismatch", "SecondOpinion", "SecondOpinions", "SilentReplica", "SpotCheckConfig", "SpotChecker",
           "ThirdOpinion", "answers_match"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpotCheckConfig:
    """How often a mixture compares an expert's answer with another server's.

    Attributes:
        fraction: the share of batches spot-checked (0: never, the default; 1: every batch).
        tolerance: the largest difference of two matching answers, per row, relative to the larger
            of their norms.
        replicas_ttl: seconds the list of an expert's servers is reused before it is read again.
        seed: seeds the sampling of batches (None: unseeded).
        opinion_share: the share of the forward timeout that a batch's opinions may take beyond its
            own calls: the second opinions once the calls are done, then the third opinions, all
            together (a server that has not answered by then gave no answer).
        evidence_partners: a server that mismatched with this many distinct servers, in mismatches
            no third server decided, is blamed (at least 2: one liar alone must not frame anyone).
    """

    fraction: float = 0.0
    tolerance: float = 0.05
    replicas_ttl: float = 10.0
    seed: int | None = None
    opinion_share: float = 0.25
    evidence_partners: int = 2

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ConfigError(f"fraction must be within [0, 1], got {self.fraction!r}")
        if not self.tolerance > 0 or self.replicas_ttl < 0:
            raise ConfigError("tolerance must be positive and replicas_ttl >= 0")
        if not 0.0 < self.opinion_share <= 1.0:
            raise ConfigError(f"opinion_share must be within (0, 1], got {self.opinion_share!r}")
        if self.evidence_partners < 2:
            raise ConfigError(f"evidence_partners must be at least 2, got {self.evidence_partners!r}")


class ReplicaMismatch(MisbehavingExpert):
    """Two servers of one expert answered the same rows differently.

    Attributes:
        blamed: the server shown to lie (contradicted by a third, or its answer malformed); None when
            two servers disagree and nothing tells which one lies.
        servers: the servers that answered differently.
    """

    def __init__(self, message: str, blamed: str | None, servers: tuple[str, ...]) -> None:
        super().__init__(message, "mismatch")
        self.blamed = blamed
        self.servers = servers


class SilentReplica(MoEError):
    """A server asked for a second or third opinion gave no answer in time (a hostile server, or a dead
    one whose declaration has not expired yet): it is avoided like a server that timed out.

    Attributes:
        addr: the server.
    """

    def __init__(self, message: str, addr: str) -> None:
        super().__init__(message)
        self.addr = addr


def answers_match(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    """Whether `b` is `a` within `tolerance`, row by row (finite, same shape; see the module)."""
    if a.shape != b.shape or a.dtype != b.dtype or not bool(torch.isfinite(b).all()):
        return False
    if a.shape[0] == 0:
        return True
    diff = row_norms(a.float() - b.float())
    norms_a = row_norms(a)
    scale = torch.maximum(norms_a, row_norms(b)).clamp_min(max(typical_norm(norms_a), 1e-12))
    return bool((diff <= tolerance * scale).all())


@dataclass(frozen=True)
class SecondOpinion:
    """What another server of a job's expert answered for the job's rows."""

    job: int
    addr: str
    outputs: list[torch.Tensor]


@dataclass(frozen=True)
class ThirdOpinion:
    """What a third server of a mismatching job's expert answered (`outputs` None: no answer in time)."""

    addr: str
    outputs: list[torch.Tensor] | None


@dataclass
class SecondOpinions:
    """The second opinions of one batch, as they arrive.

    Attributes:
        asked: per job asked, ``(job, server)``.
        found: the answers that came.
    """

    asked: list[tuple[int, str]] = field(default_factory=list)
    found: list[SecondOpinion] = field(default_factory=list)

    def unanswered(self) -> list[tuple[int, str]]:
        """The ``(job, server)`` asked that gave no answer (yet)."""
        answered = {o.job for o in self.found}
        return [(j, addr) for j, addr in self.asked if j not in answered]


class SpotChecker:
    """Samples batches and asks other servers of their experts (used on the peer's loop, except `sample`).

    Args:
        config: how often and how strictly.
        source: where the servers of an expert are found.
        peer: the calling peer (its connection pool).
        avoided: the servers the mixture avoids now (never asked for an opinion).
        timeout: deadline of each spot-check call, seconds.
    """

    def __init__(self, config: SpotCheckConfig, source: ExpertSource, peer: PeerHandle,
                 avoided: Callable[[], Collection[str]], timeout: float) -> None:
        self.config = config
        self.source = source
        self.peer = peer
        self.avoided = avoided
        self.timeout = timeout
        self._random = random.Random(config.seed)
        self._replicas: dict[str, tuple[float, list[str]]] = {}
        self.checked = 0
        """Answers compared with another server's so far."""
        self.mismatches = 0
        """Comparisons that found a mismatch so far."""
        self.evidence: dict[str, int] = {}
        """Per server, the mismatches it was part of."""
        self.blamed_on_evidence = 0
        """Servers blamed on accumulated evidence so far (no third server decided their mismatches)."""
        self._partners: dict[str, set[str]] = {}

    @property
    def opinion_timeout(self) -> float:
        """Seconds a batch's second opinions may take after its own calls, and its third opinions."""
        return self.config.opinion_share * self.timeout

    def sample(self) -> bool:
        """Whether the next batch is spot-checked (on the calling thread)."""
        return self.config.fraction > 0 and self._random.random() < self.config.fraction

    async def replicas(self, uids: Sequence[str]) -> dict[str, list[str]]:
        """The servers of each of `uids`, from the cache or the source."""
        now = time.monotonic()
        missing = [u for u in dict.fromkeys(uids) if u not in self._replicas or self._replicas[u][0] <= now]
        if missing:
            found = await self.source.get_replicas(missing)
            for uid in missing:
                self._replicas[uid] = (now + self.config.replicas_ttl, found.get(uid, []))
        return {uid: self._replicas[uid][1] for uid in uids}

    async def ask(self, uid: str, addr: str, rows: torch.Tensor, timeout: float | None = None
                  ) -> list[torch.Tensor] | None:
        """The answer of the server at `addr` for `rows` within `timeout` (default: the checker's);
        None when the call failed: no opinion."""
        timeout = self.timeout if timeout is None else timeout
        try:
            outputs, _ = await call_forward_keeping(self.peer.pool.get(addr), uid, [rows], timeout=timeout)
        except Exception as e:  # noqa: BLE001 - a server that does not answer gives no evidence
            logger.debug("spot check of %s at %s got no answer: %s", uid, addr, e)
            return None
        return outputs

    async def second_opinions(
        self, jobs: Sequence[tuple[str, str]], rows: Sequence[torch.Tensor], into: SecondOpinions
    ) -> None:
        """Asks, for each job ``(uid, server)`` whose expert has another server not avoided, one of
        those other servers for the job's `rows`, all at once; records in `into` whom it asked, and
        each answer as it arrives (so a caller that stops waiting keeps those that came)."""
        replicas = await self.replicas([uid for uid, _ in jobs])
        avoided = set(self.avoided())
        for j, (uid, addr) in enumerate(jobs):
            others = [a for a in replicas[uid] if a != addr and a not in avoided]
            if others:
                into.asked.append((j, self._random.choice(others)))

        async def one(j: int, addr: str) -> None:
            outputs = await self.ask(jobs[j][0], addr, rows[j])
            if outputs is not None:
                into.found.append(SecondOpinion(j, addr, outputs))

        await asyncio.gather(*(one(j, addr) for j, addr in into.asked))

    async def third_opinions(
        self, asks: Sequence[tuple[str, Collection[str], torch.Tensor]]
    ) -> list[ThirdOpinion | None]:
        """For each ``(uid, servers, rows)``, the answer of a server of `uid` other than `servers` and
        not avoided (None: no such server), all asked at once, each within `opinion_timeout`."""
        replicas = await self.replicas([uid for uid, _, _ in asks])
        avoided = set(self.avoided())
        chosen: list[str | None] = []
        for uid, servers, _ in asks:
            others = [a for a in replicas[uid] if a not in servers and a not in avoided]
            chosen.append(self._random.choice(others) if others else None)
        asked = {i: addr for i, addr in enumerate(chosen) if addr is not None}
        timeout = self.opinion_timeout
        tasks = {i: asyncio.ensure_future(self.ask(asks[i][0], addr, asks[i][2], timeout)) for i, addr in asked.items()}
        if tasks:
            await asyncio.wait(tasks.values(), timeout=timeout)  # the call's own deadline, and this one
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        found: list[ThirdOpinion | None] = [None] * len(asks)
        for i, task in tasks.items():
            found[i] = ThirdOpinion(asked[i], task.result() if not task.cancelled() else None)
        return found

    @staticmethod
    def _single(outputs: list[torch.Tensor] | None) -> torch.Tensor | None:
        return outputs[0] if outputs is not None and len(outputs) == 1 else None

    def matches(self, answer: torch.Tensor, opinion: SecondOpinion) -> bool:
        """Whether a job's accepted `answer` matches its second opinion (counted in `checked`)."""
        self.checked += 1
        second = self._single(opinion.outputs)
        return second is not None and answers_match(answer, second, self.config.tolerance)

    def needs_third(self, answer: torch.Tensor, opinion: SecondOpinion) -> bool:
        """Whether a mismatching second opinion is well formed, so that only a third server can tell
        which of the two lies (a malformed one blames its own server)."""
        second = self._single(opinion.outputs)
        return second is not None and second.shape == answer.shape and bool(torch.isfinite(second).all())

    def judge(self, uid: str, primary: str, answer: torch.Tensor, opinion: SecondOpinion,
              third: ThirdOpinion | None) -> ReplicaMismatch:
        """Decides a mismatch between a job's accepted `answer` (from `primary`) and its second opinion
        (`matches` said no), with the `third` opinion asked for it, if any (on the calling thread).

        Returns:
            The mismatch, whose `blamed` says which server lied, if known (see the module).
        """
        self.mismatches += 1
        servers = (primary, opinion.addr)
        for addr in servers:
            self.evidence[addr] = self.evidence.get(addr, 0) + 1
        blamed: str | None
        if not self.needs_third(answer, opinion):
            blamed, how = opinion.addr, "its second server answered a malformed spot check"
        else:
            second = self._single(opinion.outputs)
            tie_answer = self._single(third.outputs) if third is not None else None
            tolerance = self.config.tolerance
            if tie_answer is not None and answers_match(answer, tie_answer, tolerance):
                blamed, how = opinion.addr, "a third server agreed with the first"
            elif tie_answer is not None and second is not None and answers_match(second, tie_answer, tolerance):
                blamed, how = primary, "a third server agreed with the second"
            else:
                blamed, how = self._blame_on_evidence(primary, opinion.addr)
        count_event("rejected", "forward", "mismatch")
        error = ReplicaMismatch(f"expert {uid}: servers {primary} and {opinion.addr} answered a spot check "
                                f"differently ({how})", blamed, servers)
        if blamed is None:
            logger.warning("%s: the answer stands, neither server avoided", error)
        else:
            logger.warning("%s: %s is avoided", error, blamed)
        return error

    def _blame_on_evidence(self, primary: str, second: str) -> tuple[str | None, str]:
        """Records an undecided mismatch; the server it makes reach `evidence_partners` distinct
        partners is blamed (when only one of the two does, or it has more)."""
        for addr, partner in ((primary, second), (second, primary)):
            self._partners.setdefault(addr, set()).add(partner)
        counts = {addr: len(self._partners[addr]) for addr in (primary, second)}
        suspects = sorted((a for a in counts if counts[a] >= self.config.evidence_partners), key=lambda a: -counts[a])
        if not suspects or (len(suspects) == 2 and counts[primary] == counts[second]):
            return None, "no third server told which one lies"
        blamed = suspects[0]
        del self._partners[blamed]  # avoided for a while; after that, only fresh evidence blames it again
        self.blamed_on_evidence += 1
        return blamed, f"no third server decided, and {blamed} mismatched {counts[blamed]} distinct servers"
