"""Spot checks: a sampled fraction of a mixture's batches also sent to a second server of the same expert.

The answer checks (`swarm.moe.client.answer_checks`) catch answers that are not finite, of another
shape or far too large; they cannot see an answer of honest size that is simply wrong (negated,
computed by another model). Where an expert is served by several servers (replicas, found with
`ExpertSource.get_replicas`), a mixture can ask a second one for the same rows and compare. Off by
default (`SpotCheckConfig.fraction` = 0): each spot-checked batch costs one more forward per
expert that has a replica, sent at the same time as the batch's own calls.

Two answers match when, in every row, their difference is at most `tolerance` times the larger of
their norms (floored at the answer's median row norm). A mismatch is evidence that one of the two
servers lies, not which:

- if a third server of the expert exists, it is asked too, and the server it contradicts is blamed:
  avoided for `AnswerChecks.avoid_for` seconds like the server of a rejected answer (and, when it is
  the one the batch used, its answer is dropped: the expert fails for the batch, `k_min` decides);
- a second opinion that is not finite or not of the answer's shape blames its own server at once;
- otherwise (two servers that disagree) the batch drops the answer (the expert fails for it) and
  both servers are recorded as involved, but neither is avoided: one liar must not be able to get
  an honest server avoided by contradicting it.

Every mismatch is logged (WARNING) and counted in ``swarm_moe_rejected_answers_total`` with
reason ``mismatch``; `SpotChecker.evidence` holds, per server, the mismatches it was part of.

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
from dataclasses import dataclass

import torch

from swarm.core.errors import ConfigError
from swarm.dht.handle import PeerHandle
from swarm.moe.client.answer_checks import MisbehavingExpert, count_event
from swarm.moe.magnitudes import row_norms, typical_norm
from swarm.moe.protocol import call_forward_keeping
from swarm.moe.sources import ExpertSource

__all__ = ["ReplicaMismatch", "SpotCheckConfig", "SpotChecker", "answers_match"]

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
    """

    fraction: float = 0.0
    tolerance: float = 0.05
    replicas_ttl: float = 10.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ConfigError(f"fraction must be within [0, 1], got {self.fraction!r}")
        if not self.tolerance > 0 or self.replicas_ttl < 0:
            raise ConfigError("tolerance must be positive and replicas_ttl >= 0")


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

    async def ask(self, uid: str, addr: str, rows: torch.Tensor) -> list[torch.Tensor] | None:
        """The answer of the server at `addr` for `rows` (None when the call failed: no opinion)."""
        try:
            outputs, _ = await call_forward_keeping(self.peer.pool.get(addr), uid, [rows], timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 - a server that does not answer gives no evidence
            logger.debug("spot check of %s at %s got no answer: %s", uid, addr, e)
            return None
        return outputs

    async def second_opinions(
        self, jobs: Sequence[tuple[str, str]], rows: Sequence[torch.Tensor]
    ) -> list[SecondOpinion]:
        """Asks, for each job ``(uid, server)`` whose expert has another server not avoided, one of
        those other servers for the job's `rows`, all at once."""
        replicas = await self.replicas([uid for uid, _ in jobs])
        avoided = set(self.avoided())
        asked: list[tuple[int, str]] = []
        for j, (uid, addr) in enumerate(jobs):
            others = [a for a in replicas[uid] if a != addr and a not in avoided]
            if others:
                asked.append((j, self._random.choice(others)))
        answers = await asyncio.gather(*(self.ask(jobs[j][0], addr, rows[j]) for j, addr in asked))
        return [SecondOpinion(j, addr, out) for (j, addr), out in zip(asked, answers) if out is not None]

    async def third_opinion(self, uid: str, servers: Collection[str], rows: torch.Tensor) -> list[torch.Tensor] | None:
        """One more server's answer for `rows`, from a server of `uid` other than `servers` (None: no
        such server, or no answer)."""
        replicas = await self.replicas([uid])
        avoided = set(self.avoided())
        others = [a for a in replicas[uid] if a not in servers and a not in avoided]
        if not others:
            return None
        return await self.ask(uid, self._random.choice(others), rows)

    def judge(self, uid: str, primary: str, answer: torch.Tensor, opinion: SecondOpinion,
              third: Callable[[], list[torch.Tensor] | None]) -> ReplicaMismatch | None:
        """Compares a job's accepted `answer` (from `primary`) with a second opinion (on the calling
        thread; `third` asks a third server, blocking, only on a mismatch).

        Returns:
            None when they match; else the mismatch, whose `blamed` says which server lied, if known.
        """
        self.checked += 1
        second = opinion.outputs[0] if len(opinion.outputs) == 1 else None
        if second is not None and answers_match(answer, second, self.config.tolerance):
            return None
        self.mismatches += 1
        servers = (primary, opinion.addr)
        for addr in servers:
            self.evidence[addr] = self.evidence.get(addr, 0) + 1
        if second is None or second.shape != answer.shape or not bool(torch.isfinite(second).all()):
            blamed: str | None = opinion.addr
            how = "its second server answered a malformed spot check"
        else:
            tie = third()
            tie_answer = tie[0] if tie is not None and len(tie) == 1 else None
            if tie_answer is not None and answers_match(answer, tie_answer, self.config.tolerance):
                blamed, how = opinion.addr, "a third server agreed with the first"
            elif tie_answer is not None and answers_match(second, tie_answer, self.config.tolerance):
                blamed, how = primary, "a third server agreed with the second"
            else:
                blamed, how = None, "no third server told which one lies"
        count_event("rejected", "forward", "mismatch")
        error = ReplicaMismatch(f"expert {uid}: servers {primary} and {opinion.addr} answered a spot check "
                                f"differently ({how})", blamed, servers)
        if blamed is None:
            logger.warning("%s: the answer is dropped for this batch, neither server avoided", error)
        else:
            logger.warning("%s: %s is avoided", error, blamed)
        return error
