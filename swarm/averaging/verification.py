"""Checking a part's reducer: digests, input sketches, and the leader's verdict.

A reducer could lie: send a part that is not the aggregate of what it received, or different
values to different members. In a verified round (`AllReduceConfig.verify`, on in robust mode)
the result of every part is linear in its contributors' inputs with published coefficients
(`robust`: `result = sum_i a_i x_i`; the plain mean: `a_i = w_i / W`), and each reducer puts in
its `ResultHeader`:

- `digest`: SHA-256 (first 16 bytes) of the part's float32 values;
- `clip_scales`, `clip_tau`, `clip_step`: CenteredClip's outcome (robust mode), hence the `a_i`;
- `sketches`: per contributor, `SKETCHES` projections `<r_l, x_i>` of the input it received, on
  random sign vectors `r_l` seeded by (round, part, digest): fixed only once the result is, so a
  reducer cannot aim a lie at the vectors' blind spots without changing them (Fiat-Shamir).
  It can retry: a lie that moves mass between two coordinates passes a sign vector when its two
  signs agree, so one try in 2**SKETCHES (256) passes all of them; each try costs it a digest
  and the sketches of every input, and a round's deadline bounds the tries.

A member that holds part j checks (`check_part`, no networking): the values match the digest;
its own input's sketches match what the reducer claims it received; `<r_l, result>` equals
`sum_i a_i t_il`; its own clip scale is no smaller than its distance from the result allows; in
absolute-tau mode the radius is the agreed one; and no contributor (the reducer's own input
included, which nobody else can see) pulls the result further than the radius allows, estimated
from the sketches (Johnson-Lindenstrauss). Then every member sends the leader the digests it
holds and what its checks caught (`VerifyReport`); the leader answers every member with one
verdict (`Verdict`): digests that differ between members (equivocation) or a caught check fail
the round for everyone, naming the reducer. Limits: docs/architecture.md, "Robust averaging".
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from swarm.averaging.group import GroupInfo
from swarm.averaging.parts import RoundFailed
from swarm.proto import averaging_pb2

SKETCHES = 8                 # projections per input: one random byte per coordinate gives its sign in each
DIGEST_BYTES = 16
SKETCH_RTOL = 1e-4           # float32 reorderings stay far below; a lie must hide under it in every sketch
PULL_SLACK = 3.0             # allowed |c_i| * estimated distance, in units of (tau + step)
# automatic radius: tau may be at most this times tau_scale times the median estimated distance
# of the inputs from the result. The honest tau is measured from the medoid (an input: about
# sqrt(2) times farther from the others than the result is, for inputs scattered alike), and an
# 8-projection estimate of a distance falls below half the true one with a chance of about 1%.
TAU_SLACK = 4.0
# A lossy codec sends the part as the codec rounds it, so the combination check allows the
# codec's own error, relative to the part's scale (the codecs' bounds on values of order 1): a
# lie within it passes, as the codec's rounding does.
# UNIFORM_4BIT (5): its relative L2 error is 0.07-0.11 on uniform and normal values and 0.25 on
# heavy-tailed ones, against 0.004-0.01 (0.04) for UNIFORM_8BIT, whose entry is about 3x its error.
CODEC_RTOL = {0: SKETCH_RTOL, 1: 2e-3, 2: 2e-3, 3: 0.03, 4: 0.25, 5: 0.35}


class ReducerLied(RoundFailed):
    """A verified round failed because a reducer's part did not pass the members' checks.

    Attributes:
        peer_id: the reducer caught.
        reported_by: PeerID of the member whose check caught it.
    """

    def __init__(self, round_id: bytes, peer_id: str, reported_by: str, reason: str) -> None:
        super().__init__(round_id, f"reducer {peer_id} caught lying (reported by {reported_by[-8:]}): {reason}")
        self.peer_id = peer_id
        self.reported_by = reported_by


def part_digest(values: torch.Tensor) -> bytes:
    """SHA-256 (first 16 bytes) of a float32 part's bytes: hardware-accelerated on current CPUs,
    about 1.6 times the speed of blake2b here."""
    h = hashlib.sha256()
    if values.numel():
        h.update(values.detach().contiguous().view(torch.uint8).numpy().data)
    return h.digest()[:DIGEST_BYTES]


def _seed(round_id: bytes, part: int, digest: bytes) -> int:
    h = hashlib.blake2b(round_id + part.to_bytes(4, "little") + digest, digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


# row k: the signs of the SKETCHES vectors at a coordinate whose random byte is k
_SIGNS = torch.tensor([[1.0 if (k >> bit) & 1 else -1.0 for bit in range(SKETCHES)] for k in range(1 << SKETCHES)],
                      dtype=torch.float64)


def sign_classes(size: int, round_id: bytes, part: int, digest: bytes) -> torch.Tensor:
    """One random byte per coordinate of the part (int64 tensor of `size` values in 0..255), seeded by
    (round, part, digest): bit l of coordinate t's byte is the sign of sign vector l at t."""
    gen = torch.Generator().manual_seed(_seed(round_id, part, digest))
    words = torch.randint(-(1 << 63), (1 << 63) - 1, ((size + 7) // 8,), dtype=torch.int64, generator=gen)
    return words.view(torch.uint8)[:size].long()


def sketch(inputs: Sequence[torch.Tensor], round_id: bytes, part: int, digest: bytes,
           classes: torch.Tensor | None = None) -> torch.Tensor:
    """(len(inputs), SKETCHES) float64 projections of equal-length 1-D tensors on the part's random
    sign (Rademacher) vectors. Each input's coordinates are summed per random byte (one bincount
    pass in float64, no sign matrix built), and the 256 sums combined with each vector's signs.

    `classes`: `sign_classes` of the part, when the caller computed them already."""
    n = len(inputs)
    if not n or not inputs[0].numel():
        return torch.zeros(n, SKETCHES, dtype=torch.float64)
    if classes is None:
        classes = sign_classes(inputs[0].numel(), round_id, part, digest)
    sums = torch.stack([torch.bincount(classes, weights=x.double(), minlength=1 << SKETCHES) for x in inputs])
    return sums @ _SIGNS


@dataclass(frozen=True)
class PartClaim:
    """What a part's reducer published with it (`ResultHeader`), decoded."""

    digest: bytes
    scales: tuple[float, ...]
    tau: float
    step: float
    sketches: torch.Tensor  # (contributors, SKETCHES)

    @classmethod
    def from_header(cls, header: averaging_pb2.ResultHeader, contributors: int) -> PartClaim:
        values = list(header.sketches)
        if len(values) != contributors * SKETCHES:
            raise ValueError(f"{len(values)} sketch values for {contributors} contributors")
        scales = tuple(header.clip_scales) or (1.0,) * contributors
        if len(scales) != contributors:
            raise ValueError(f"{len(scales)} clip scales for {contributors} contributors")
        return cls(header.digest, scales, header.clip_tau, header.clip_step,
                   torch.tensor(values, dtype=torch.float64).view(contributors, SKETCHES))


def check_part(
    claim: PartClaim, values: torch.Tensor, own: torch.Tensor | None, me: int, contributors: Sequence[int],
    weights: Sequence[float], round_id: bytes, part: int, robust: bool, tau: float | None, codec: int = 0,
    tau_scale: float = 1.0,
) -> str:
    """A member's checks of one part it holds; returns why it fails ("" when it passes).

    Args:
        claim: what the reducer published.
        values: the part as this member holds it.
        own: this member's own input to the part (None if it is not a contributor).
        me: this member's index; `contributors` and `weights` as in the decision.
        round_id, part: which part.
        robust: robust mode (clip scales published) or the plain mean.
        tau: the agreed absolute radius, or None (automatic: `tau_scale` times the median
            distance of the inputs from their medoid, bounded here from the sketches).
        codec: the round's wire codec (`CompressionType` value): how much rounding to allow.
        tau_scale: the agreed `AllReduceConfig.clip_tau_scale` (automatic radius).
    """
    if part_digest(values) != claim.digest:
        return "the values differ from the digest published with them"
    scales = claim.scales
    if any(not (math.isfinite(c) and 0 <= c <= 1) for c in scales):
        return "clip scales outside [0, 1]"
    if robust:
        if not (math.isfinite(claim.tau) and claim.tau > 0 and math.isfinite(claim.step) and 0 <= claim.step <= claim.tau):
            return "invalid clipping radius or step"
        if tau is not None and not math.isclose(claim.tau, tau, rel_tol=1e-9):
            return f"clipping radius {claim.tau} instead of the agreed {tau}"
    pulls = [w * c for w, c in zip(weights, scales)]
    total = sum(pulls)
    if not total > 0:
        return "every contributor clipped to nothing"
    coefficients = [p / total for p in pulls]
    mine = sketch([values] + ([own] if own is not None else []), round_id, part, claim.digest)
    result_sketch = mine[0]
    if own is not None:
        k = list(contributors).index(me)
        allowed = SKETCH_RTOL * float(mine[1].norm()) + 1e-30
        if float((claim.sketches[k] - mine[1]).abs().max()) > allowed:
            return "the input it claims to have received from this member is not what this member sent"
        if robust:
            d = float(torch.linalg.vector_norm(own - values)) + claim.step
            if codec:  # the values held are the codec's rounding of the result
                d += CODEC_RTOL.get(codec, 1.0) * float(torch.linalg.vector_norm(values))
            least = 1.0 if d <= claim.tau else claim.tau / d
            if scales[k] < least * (1 - 1e-6):
                return f"this member's input clipped to {scales[k]:.3g}, its distance allows {least:.3g}"
    combined = sum(a * claim.sketches[i] for i, a in enumerate(coefficients))
    scale = sum(a * float(claim.sketches[i].norm()) for i, a in enumerate(coefficients)) + float(result_sketch.norm())
    if float((combined - result_sketch).abs().max()) > CODEC_RTOL.get(codec, 1.0) * scale + 1e-30:
        return "the part is not the published combination of the inputs received"
    if robust and tau is None:
        reason = _check_auto_tau(claim, result_sketch, weights, tau_scale)
        if reason:
            return reason
    if robust:
        limit = PULL_SLACK * (claim.tau + claim.step)
        for i, c in enumerate(scales):
            estimate = float((claim.sketches[i] - result_sketch).norm()) / math.sqrt(SKETCHES)
            if c * estimate > limit:
                return f"member {contributors[i]}'s input pulls the part {c * estimate:.3g} > {limit:.3g}"
    return ""


def _check_auto_tau(claim: PartClaim, result_sketch: torch.Tensor, weights: Sequence[float], tau_scale: float) -> str:
    """An automatic radius no larger than the inputs' spread allows (a reducer that inflates it
    would leave its accomplices' inputs unclipped): `TAU_SLACK * tau_scale` times the (lower)
    median of the contributors' estimated distances from the result."""
    distances = sorted(float((claim.sketches[i] - result_sketch).norm()) / math.sqrt(SKETCHES)
                       for i, w in enumerate(weights) if w > 0)
    if not distances:
        return ""
    spread = distances[(len(distances) - 1) // 2]
    size = float(result_sketch.norm()) / math.sqrt(SKETCHES)
    if len(distances) <= 2 or spread <= 1e-6 * size:
        # the radius robust.py falls back to: the median distance from the medoid of one or two
        # inputs is the medoid's own 0, as it is when most inputs equal the result
        limit = 1.0
    else:
        limit = TAU_SLACK * tau_scale * spread
    if claim.tau > limit * (1 + 1e-9):
        return f"clipping radius {claim.tau:.4g} exceeds what the inputs' spread allows ({limit:.4g})"
    return ""


@dataclass
class Verdict:
    """The leader's collection of `VerifyReport`s for one round, and its one verdict.

    Args:
        group: the round's group.
        expected: member indices whose reports it waits for: the decision's contributors (they
            all held data moments ago), given by the leader's coordinator once it decided.
        until: loop time after which the verdict is given without the reports still missing.
        grace: seconds after the first report after which it is given all the same (members
            hold every part at about the same time; the first are waiting on it).
    """

    group: GroupInfo
    expected: Callable[[], frozenset[int]]
    until: float
    grace: float = math.inf
    reports: dict[int, averaging_pb2.VerifyReport] = field(default_factory=dict)
    _all_in: asyncio.Event = field(default_factory=asyncio.Event)
    _verdict: averaging_pb2.VerifyVerdict | None = None
    _first: float | None = None

    async def submit(self, report: averaging_pb2.VerifyReport) -> averaging_pb2.VerifyVerdict:
        """Records one member's report; waits for the others (until `until`, or `grace` after the
        first report), then answers the verdict."""
        now = asyncio.get_running_loop().time()
        if self._first is None:
            self._first = now
        wait = min(self.until, self._first + self.grace) - now
        expected = self.expected()
        if 0 <= report.member < len(self.group.members):
            self.reports.setdefault(report.member, report)
        if expected <= set(self.reports):
            self._all_in.set()
        try:
            await asyncio.wait_for(self._all_in.wait(), max(0.0, wait))
        except TimeoutError:
            pass
        if self._verdict is None:
            self._verdict = self.decide()
        return self._verdict

    def decide(self) -> averaging_pb2.VerifyVerdict:
        """Fails on the first accusation or digest disagreement (lowest member index first)."""
        for i in sorted(self.reports):
            r = self.reports[i]
            if r.accused:
                return averaging_pb2.VerifyVerdict(ok=False, accused=r.accused[0], reported_by=i, reason=r.reasons[0])
        n_parts = len(self.group.reducers)
        for part in range(n_parts):
            seen: dict[bytes, list[int]] = {}
            for i in sorted(self.reports):
                digests = self.reports[i].digests
                if len(digests) == n_parts:
                    seen.setdefault(digests[part], []).append(i)
            if len(seen) > 1:
                minority = min(seen.values(), key=len)
                return averaging_pb2.VerifyVerdict(
                    ok=False, accused=self.group.reducers[part], reported_by=minority[0],
                    reason=f"members hold different values of part {part} (equivocation, or member "
                           f"{self.group.members[minority[0]].peer_id[-8:]} misreports)",
                )
        return averaging_pb2.VerifyVerdict(ok=True)


__all__ = ["SKETCHES", "PartClaim", "ReducerLied", "Verdict", "check_part", "part_digest", "sketch"]
