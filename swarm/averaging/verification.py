"""Checking a part's reducer: digests, input sketches, and the leader's verdict.

A reducer could lie: send a part that is not the aggregate of what it received, or different
values to different members. In a verified round (`AllReduceConfig.verify`, on in robust mode)
the result of every part is linear in its contributors' inputs with published coefficients
(`robust`: `result = sum_i a_i x_i`; the plain mean: `a_i = w_i / W`), and each reducer puts in
its `ResultHeader`:

- `digest`: SHA-256 (first 16 bytes) of the part's float32 values;
- `clip_scales`, `clip_tau`, `clip_step`: CenteredClip's outcome (robust mode), hence the `a_i`;
- `sketches`: per contributor, the `CLASSES` (256) class sums of the input it received: every
  coordinate draws a random byte seeded by (round, part, digest), and a class sums the
  coordinates that drew its byte. Bit l of the byte is the coordinate's sign in random sign
  vector l, so the class sums give the `SKETCHES` (8) projections `<r_l, x_i>` (`projections`).
  The bytes are fixed only once the result is, so a reducer cannot aim a lie at them without
  changing them (Fiat-Shamir). It can retry: a lie that moves mass between two coordinates goes
  unseen when both drew the same byte, so one try in 256 passes; each try costs it a digest
  and the sketches of every input, and a round's deadline bounds the tries.
- `distances`: per contributor, the distance of its input from the part as sent.

A member that holds part j checks (`check_part`, no networking): the values match the digest;
its own input's sketch and distance match what the reducer claims it received; `<r_l, result>`
equals `sum_i a_i <r_l, x_i>` up to the codec's rounding and the float32 sums, and so does every
class sum, up to the rounding in that class (no randomness in its allowance); its own clip scale is no
smaller than its distance from the result allows; the radius is the agreed one, or (automatic)
at most `robust.RADIUS_BOUND * tau_scale` times the median published distance; no published
distance is much less than the sketches' estimate of it (Johnson-Lindenstrauss); and no
contributor (the reducer's own input included, which nobody else can see) pulls the result
further than the radius allows. Each check fails an honest reducer with odds below 1e-9 per
part (docs/security.md, "How often a check fails an honest reducer"). Then every member sends the leader the digests it
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
from swarm.averaging.robust import RADIUS_BOUND, result_distances
from swarm.compression.quantile import BLOCK_NUMEL as QUANTILE_BLOCK
from swarm.compression.quantile import SORT_NUMEL as QUANTILE_SORT
from swarm.compression.uniform4 import BLOCK as UNIFORM4_BLOCK
from swarm.proto import averaging_pb2

SKETCHES = 8                 # projections per input: one random byte per coordinate gives its sign in each
CLASSES = 1 << SKETCHES      # a sketch: per value of that byte, the sum of the coordinates that drew it
DIGEST_BYTES = 16
# Every check below fails an honest reducer with probability at most 1e-9 per part; the
# derivation of each allowance is in docs/security.md, "How often a check fails an honest reducer".
U32 = 2.0 ** -24             # float32 unit roundoff
SKETCH_RTOL = 1e-4           # own input: the same float32 values projected twice, in float64
DISTANCE_RTOL = 1e-7         # own distance: the same float32 values, a float64 norm summed in another order
CLIP_RTOL = 1e-4             # CenteredClip's float32 distances (robust.py) against the member's float64 ones
Z_SIGNS = 7.0                # |<r, e>| <= Z_SIGNS ||e|| for all SKETCHES sign vectors but with odds 16 exp(-24.5) < 1e-9
PULL_SLACK = 3.2             # an input's estimated distance may exceed its claimed one this many times: odds < 1e-11
# automatic radius: tau may be at most robust.RADIUS_BOUND times tau_scale times the (lower)
# median of the contributors' distances from the part, as published (each member checks its own
# exactly); CenteredClip keeps its automatic radius within that bound by construction.


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
_SIGNS = torch.tensor([[1.0 if (k >> bit) & 1 else -1.0 for bit in range(SKETCHES)] for k in range(CLASSES)],
                      dtype=torch.float64)


def sign_classes(size: int, round_id: bytes, part: int, digest: bytes) -> torch.Tensor:
    """One random byte per coordinate of the part (int64 tensor of `size` values in 0..255), seeded by
    (round, part, digest): bit l of coordinate t's byte is the sign of sign vector l at t."""
    gen = torch.Generator().manual_seed(_seed(round_id, part, digest))
    words = torch.randint(-(1 << 63), (1 << 63) - 1, ((size + 7) // 8,), dtype=torch.int64, generator=gen)
    return words.view(torch.uint8)[:size].long()


def sketch(inputs: Sequence[torch.Tensor], round_id: bytes, part: int, digest: bytes,
           classes: torch.Tensor | None = None) -> torch.Tensor:
    """(len(inputs), CLASSES) float64 sketches of equal-length 1-D tensors: per random byte
    (`sign_classes`), the sum of the coordinates that drew it (one bincount pass in float64). What
    a reducer publishes per contributor; `projections` turns a sketch into its SKETCHES projections
    on the part's random sign vectors.

    `classes`: `sign_classes` of the part, when the caller computed them already."""
    n = len(inputs)
    if not n or not inputs[0].numel():
        return torch.zeros(n, CLASSES, dtype=torch.float64)
    if classes is None:
        classes = sign_classes(inputs[0].numel(), round_id, part, digest)
    return torch.stack([torch.bincount(classes, weights=x.double(), minlength=CLASSES) for x in inputs])


def projections(sketches: torch.Tensor) -> torch.Tensor:
    """(..., SKETCHES) projections on the part's random sign (Rademacher) vectors of inputs given by
    their (..., CLASSES) sketches: each class's sum combined with each vector's signs there."""
    return sketches @ _SIGNS


def input_distances(inputs: Sequence[torch.Tensor], values: torch.Tensor) -> list[float]:
    """Per input, its L2 distance from `values` (float32 differences, summed in float64): what a
    reducer publishes (`ResultHeader.distances`) and what each member recomputes for its own input."""
    return result_distances(inputs, values)


def _ulp(magnitude: float) -> float:
    return math.ldexp(1.0, math.frexp(magnitude)[1] - 23) if magnitude > 0 else 0.0


def _ulps(magnitude: torch.Tensor) -> torch.Tensor:
    """`_ulp` of each element of a float64 tensor of magnitudes."""
    _, exponent = torch.frexp(magnitude)
    return torch.where(magnitude > 0, torch.ldexp(torch.ones_like(magnitude), exponent - 23), torch.zeros_like(magnitude))


def _uniform(chunk: torch.Tensor, where: torch.Tensor | None, block: int, levels: int) -> tuple[float, torch.Tensor | None]:
    """A uniform codec's rounding of one chunk, in blocks of `block` elements with a range each:
    every element lies within half a step of its value, the step recovered from the block's
    decoded extremes (codes 0 and `levels`), plus a few float32 ulps of the decoding arithmetic.
    Returns the squared L2 bound and (`where`: the elements' classes) the per-class L1 bounds."""
    m = chunk.numel()
    full = m - m % block
    highs, lows = [], []
    if full:
        rows = chunk[:full].view(-1, block)
        highs.append(rows.amax(dim=1))
        lows.append(rows.amin(dim=1))
    if full < m:
        highs.append(chunk[full:].max().view(1))
        lows.append(chunk[full:].min().view(1))
    high, low = torch.cat(highs), torch.cat(lows)
    bound = 1.01 * (high - low) / levels / 2 + 4 * _ulps(torch.maximum(high.abs(), low.abs()))  # per block
    # a step below float32's normal range is stored with few bits (or inverted to inf, every
    # element then decoding to an extreme): the block's whole range, plus a subnormal per code
    tiny = (high - low) / levels < 2.0 ** -126
    if bool(tiny.any()):
        bound = torch.where(tiny, (high - low) + levels * 2.0 ** -149 + bound, bound)
    sizes = torch.full_like(bound, block)
    sizes[-1] = m - (bound.numel() - 1) * block
    squared = float((sizes * bound ** 2).sum())
    if where is None:
        return squared, None
    per_element = bound.repeat_interleave(sizes.long()) if bound.numel() > 1 else bound.expand(m)
    return squared, torch.bincount(where, weights=per_element, minlength=CLASSES)


def _quantile(block: torch.Tensor, where: torch.Tensor | None) -> tuple[float, torch.Tensor | None]:
    """QUANTILE_8BIT's rounding of one block (swarm/compression/quantile.py). An element decodes to
    its bucket's mean, and buckets are value intervals: an element of an inner level lies between
    the levels either side; one of the lowest (highest) level lies below (above) the next level,
    at most a gap past its level, and the level is the mean of its elements, so those on the
    other side add up to at most (n - 1) gaps, and the squared errors of all n to at most
    n (n - 1) gap**2.
    Returns the squared L2 bound and (`where`: the elements' classes) the per-class L1 bounds."""
    levels, index, counts = torch.unique(block, sorted=True, return_inverse=True, return_counts=True)
    k = levels.numel()
    slack = 4 * _ulp(float(levels.abs().max()))
    if k == 1:
        # One level with no neighbour to bound it. Blocks of more than SORT_NUMEL elements are cut
        # on a grid of float16 cells (4 patterns of the values scaled by a power of two, relative
        # width 2**-8 at most), and any two occupied cells get two codes: so the elements share
        # one cell, or cells whose means round to one float32 (then they lie within a cell's width
        # of it): within 2**-7 of the level, relatively. Sorted blocks decode 256 distinct values
        # or fewer exactly, and more get two codes: one level then means buckets whose means
        # round to it, each bucket's elements on its side of the next, so within n + 1 ulps.
        level = float(levels.abs().max())
        spread = (block.numel() + 1) * 2 * _ulp(level) if block.numel() <= QUANTILE_SORT else 2.0 ** -7 * level
        bound = spread + slack + 2.0 ** -148
        per_class = None if where is None else torch.bincount(where, minlength=CLASSES).double() * bound
        return block.numel() * bound ** 2, per_class
    gaps = levels[1:] - levels[:-1]
    inner = torch.maximum(gaps[:-1], gaps[1:]) + slack if k > 2 else torch.zeros(0, dtype=torch.float64)
    squared = float((counts[1:-1].double() * inner ** 2).sum())
    per_class = None
    if where is not None:
        wider = torch.cat([gaps[:1] + slack, inner, gaps[-1:] + slack])  # per level: the side towards its neighbours
        per_class = torch.bincount(where, weights=wider[index], minlength=CLASSES)
    for level, gap in ((0, float(gaps[0])), (k - 1, float(gaps[-1]))):
        n = int(counts[level])
        squared += n * (n - 1) * (gap + slack) ** 2 + n * slack ** 2
        if per_class is not None and where is not None and n > 1:
            present = torch.bincount(where[index == level], minlength=CLASSES) > 0
            per_class += present.double() * (n - 1) * (gap + slack)
    return squared, per_class


def rounding_bounds(values: torch.Tensor, codec: int, chunk_numel: int,
                    classes: torch.Tensor | None = None) -> tuple[float, torch.Tensor | None]:
    """Bounds on the difference between a part's values as held (the wire codec's decoding) and
    the float32 result its reducer encoded, computed from the values alone: its L2 norm, and
    (given the coordinates' `classes`) per class the sum of its absolute values there (CLASSES
    float64 values; None without `classes`).

    Args:
        values: the part as decoded.
        codec: the round's `CompressionType` value (0: raw float32, exact).
        chunk_numel: elements per encoded chunk (each chunk has its own range or codebook).
        classes: `sign_classes` of the part.
    """
    n = values.numel()
    per_class = None if classes is None else torch.zeros(CLASSES, dtype=torch.float64)
    if codec == 0 or not n:
        return 0.0, per_class
    v = values.double()
    if codec == 1:  # FLOAT16: 2**-11 relative in the normal range, 2**-25 absolute below it
        if classes is not None:
            per_class = torch.bincount(classes, weights=2.0 ** -11 * 1.001 * v.abs() + 2.0 ** -25, minlength=CLASSES)
        return 2.0 ** -11 * 1.001 * float(torch.linalg.vector_norm(v)) + 2.0 ** -25 * math.sqrt(n), per_class
    if codec not in (2, 3, 4, 5):
        return math.inf, None if classes is None else torch.full((CLASSES,), math.inf, dtype=torch.float64)
    total = 0.0
    for a in range(0, n, max(1, chunk_numel)):
        chunk = v[a:a + chunk_numel]
        where = None if classes is None else classes[a:a + chunk_numel]
        parts: list[tuple[float, torch.Tensor | None]] = []
        if codec == 2:  # SCALED_FLOAT16: 2**-11 relative, M * 2**-39 absolute (M: the chunk's largest magnitude)
            m = float(chunk.abs().max()) * 1.001
            squared = (2.0 ** -11 * 1.001 * float(torch.linalg.vector_norm(chunk)) + 2.0 ** -39 * m * math.sqrt(chunk.numel())) ** 2
            parts.append((squared, None if where is None else
                          torch.bincount(where, weights=2.0 ** -11 * 1.001 * chunk.abs() + 2.0 ** -39 * m, minlength=CLASSES)))
        elif codec == 3:  # UNIFORM_8BIT: one range per chunk
            parts.append(_uniform(chunk, where, chunk.numel(), 255))
        elif codec == 5:  # UNIFORM_4BIT: one range per block of UNIFORM4_BLOCK elements of the chunk
            parts.append(_uniform(chunk, where, UNIFORM4_BLOCK, 15))
        else:  # QUANTILE_8BIT: one codebook per block of QUANTILE_BLOCK elements of the chunk
            parts.extend(_quantile(chunk[b:b + QUANTILE_BLOCK], None if where is None else where[b:b + QUANTILE_BLOCK])
                         for b in range(0, chunk.numel(), QUANTILE_BLOCK))
        for squared, chunk_classes in parts:
            total += squared
            if per_class is not None and chunk_classes is not None:
                per_class += chunk_classes
    return math.sqrt(total), per_class


def rounding_bound(values: torch.Tensor, codec: int, chunk_numel: int) -> float:
    """The L2 bound of `rounding_bounds`: on the codec's rounding of the part, from its values alone."""
    return rounding_bounds(values, codec, chunk_numel)[0]


@dataclass(frozen=True)
class PartClaim:
    """What a part's reducer published with it (`ResultHeader`), decoded."""

    digest: bytes
    scales: tuple[float, ...]
    tau: float
    step: float
    sketches: torch.Tensor  # (contributors, CLASSES): each input's `sketch` as received
    distances: tuple[float, ...] = ()  # per contributor, its input's distance from the part (`input_distances`)

    @classmethod
    def from_header(cls, header: averaging_pb2.ResultHeader, contributors: int) -> PartClaim:
        values = list(header.sketches)
        if len(values) != contributors * CLASSES:
            raise ValueError(f"{len(values)} sketch values for {contributors} contributors")
        scales = tuple(header.clip_scales) or (1.0,) * contributors
        if len(scales) != contributors:
            raise ValueError(f"{len(scales)} clip scales for {contributors} contributors")
        distances = tuple(header.distances)
        if len(distances) != contributors:
            raise ValueError(f"{len(distances)} distances for {contributors} contributors")
        return cls(header.digest, scales, header.clip_tau, header.clip_step,
                   torch.tensor(values, dtype=torch.float64).view(contributors, CLASSES), distances)


def check_part(
    claim: PartClaim, values: torch.Tensor, own: torch.Tensor | None, me: int, contributors: Sequence[int],
    weights: Sequence[float], round_id: bytes, part: int, robust: bool, tau: float | None, codec: int = 0,
    tau_scale: float = 1.0, chunk_numel: int = 1 << 18,
) -> str:
    """A member's checks of one part it holds; returns why it fails ("" when it passes).

    Args:
        claim: what the reducer published.
        values: the part as this member holds it.
        own: this member's own input to the part as its reducer decoded it (None if it is not a contributor).
        me: this member's index; `contributors` and `weights` as in the decision.
        round_id, part: which part.
        robust: robust mode (clip scales published) or the plain mean.
        tau: the agreed absolute radius, or None (automatic: `tau_scale` times the median
            distance of the inputs from their medoid, bounded here from the published distances).
        codec: the round's wire codec (`CompressionType` value): how much rounding to allow.
        tau_scale: the agreed `AllReduceConfig.clip_tau_scale` (automatic radius).
        chunk_numel: elements per chunk of the round's codec (where its ranges restart).
    """
    reason = _check_published(claim, values, robust, tau)
    if reason:
        return reason
    scales, distances = claim.scales, claim.distances
    pulls = [w * c for w, c in zip(weights, scales)]
    total = sum(pulls)
    if not total > 0:
        return "every contributor clipped to nothing"
    coefficients = [p / total for p in pulls]
    classes = sign_classes(values.numel(), round_id, part, claim.digest)
    eps, rounding = rounding_bounds(values, codec, chunk_numel, classes)
    assert rounding is not None  # given the classes
    # what separates the part from the published combination honestly, besides the codec's
    # rounding (eps): the float32 sums, at most 2n+4 roundings of each term, each relative or
    # (below float32's normal range) at most half the smallest subnormal
    size = float(torch.linalg.vector_norm(values.double()))
    float32_error = (2 * len(coefficients) + 4) * (
        U32 * (size + 2 * eps + sum(a * d for a, d in zip(coefficients, distances))) + 2.0 ** -150 * math.sqrt(values.numel()))
    if robust:
        # the result lies within tau * W / P of CenteredClip's last centre (each input pulls by at
        # most tau), up to float32 rounding: a larger step would loosen the pull check below
        most = claim.tau * sum(w for w in weights if w > 0) / total * (1 + CLIP_RTOL) + float32_error
        if claim.step > most:
            return f"step {claim.step:.4g} beyond what the radius allows ({most:.4g})"
    mine = sketch([values] + ([own] if own is not None else []), round_id, part, claim.digest, classes)
    if own is not None:
        reason = _check_own_input(claim, values, own, mine[1], list(contributors).index(me), robust, eps)
        if reason:
            return reason
    reason = _check_sketches(claim, mine[0], coefficients, contributors, eps + float32_error)
    if reason:
        return reason
    reason = _check_classes(claim, values, mine[0], coefficients, rounding, classes, float32_error)
    if reason:
        return reason
    if robust:
        # no input pulls the part further than the radius allows: c_i |x_i - v| <= tau + step (+ rounding)
        limit = (claim.tau + claim.step + eps) * (1 + CLIP_RTOL)
        for i, (c, d, w) in enumerate(zip(scales, distances, weights)):
            if w > 0 and c * d > limit:
                return f"member {contributors[i]}'s input pulls the part {c * d:.3g} > {limit:.3g}"
    if robust and tau is None:
        return _check_auto_tau(claim, weights, tau_scale, eps)
    return ""


def _check_published(claim: PartClaim, values: torch.Tensor, robust: bool, tau: float | None) -> str:
    """The claim on its own: the digest matches the values, the numbers are in range, and (robust
    mode) the radius is the agreed one. Why it fails, or ""."""
    if part_digest(values) != claim.digest:
        return "the values differ from the digest published with them"
    if any(not (math.isfinite(c) and 0 <= c <= 1) for c in claim.scales):
        return "clip scales outside [0, 1]"
    distances = claim.distances
    if len(distances) != len(claim.scales) or any(not (math.isfinite(d) and d >= 0) for d in distances):
        return "invalid distances of the inputs"
    if robust:
        if not (math.isfinite(claim.tau) and claim.tau > 0 and math.isfinite(claim.step) and claim.step >= 0):
            return "invalid clipping radius or step"
        if tau is not None and not math.isclose(claim.tau, tau, rel_tol=1e-9):
            return f"clipping radius {claim.tau} instead of the agreed {tau}"
    return ""


def _check_own_input(
    claim: PartClaim, values: torch.Tensor, own: torch.Tensor, own_sketch: torch.Tensor, k: int, robust: bool,
    eps: float,
) -> str:
    """What the claim says about this member's own input (contributor `k`): its sketch, its distance
    from the part and (robust mode) its clip scale are what this member can compute itself."""
    allowed = SKETCH_RTOL * float(own_sketch.norm()) + 1e-30
    if float((claim.sketches[k] - own_sketch).abs().max()) > allowed:
        return "the input it claims to have received from this member is not what this member sent"
    exact = input_distances([own], values)[0]
    published = claim.distances[k]
    if abs(published - exact) > DISTANCE_RTOL * exact + 1e-30:
        return f"this member's distance from the part published as {published:.6g}, it is {exact:.6g}"
    if robust:
        d = exact + claim.step + eps  # >= its distance from CenteredClip's last centre
        least = 1.0 if d <= claim.tau else claim.tau / d
        if claim.scales[k] < least * (1 - CLIP_RTOL):
            return f"this member's input clipped to {claim.scales[k]:.3g}, its distance allows {least:.3g}"
    return ""


def _check_sketches(
    claim: PartClaim, result_sketch: torch.Tensor, coefficients: Sequence[float], contributors: Sequence[int],
    error: float,
) -> str:
    """The part's sketch against the inputs' published sketches: each input's published distance is
    not smaller than the sketches show, and the part is their published combination (up to `error`,
    the codec's and float32's rounding)."""
    # an input's distance as published against the sketches' estimate of it: the estimate exceeds
    # PULL_SLACK times the true distance with odds below 1e-11 (docs/security.md)
    inputs, result = projections(claim.sketches), projections(result_sketch)
    for i, d in enumerate(claim.distances):
        estimate = float((inputs[i] - result).norm()) / math.sqrt(SKETCHES)
        noise = 1e-9 * (float(inputs[i].norm()) + float(result.norm()))
        if estimate > PULL_SLACK * d + noise:
            return f"member {contributors[i]}'s input is farther from the part than published ({estimate:.3g} > {d:.3g})"
    combined = sum(a * inputs[i] for i, a in enumerate(coefficients))
    scale = sum(a * float(inputs[i].norm()) for i, a in enumerate(coefficients)) + float(result.norm())
    if float((combined - result).abs().max()) > Z_SIGNS * error + 1e-12 * scale + 1e-30:
        return "the part is not the published combination of the inputs received"
    return ""


def _check_classes(
    claim: PartClaim, values: torch.Tensor, result_sketch: torch.Tensor, coefficients: Sequence[float],
    rounding: torch.Tensor, classes: torch.Tensor, float32_error: float,
) -> str:
    """The part against the published combination class by class, with no randomness in the
    allowance: in each class the sum of the part's coordinates differs from the combination of the
    inputs' sums by at most the codec's rounding there (`rounding`, summed absolute values), the
    float32 sums (at most sqrt(count) times their L2 bound) and the float64 sums. A change on a few
    coordinates lands in their classes whole, where it meets 1/CLASSES of the codec's rounding
    rather than seven times all of it."""
    combined = torch.zeros(CLASSES, dtype=torch.float64)
    for i, a in enumerate(coefficients):
        combined += a * claim.sketches[i]
    counts = torch.bincount(classes, minlength=CLASSES).double()
    n = values.numel()
    # float64: each class sum rounds at most `count` times, relative to the L1 norms of the terms
    # (an input's within sqrt(n) times its distance of the part's); the combination a few more
    mass = float(values.abs().sum(dtype=torch.float64))
    mass += sum(a * (mass + math.sqrt(n) * d) for a, d in zip(coefficients, claim.distances))
    float64 = (counts + 2 * len(coefficients) + 8) * 2.0 ** -52 * mass
    allowance = rounding + counts.sqrt() * float32_error + float64 + 1e-300
    excess = (result_sketch - combined).abs() - allowance
    worst = int(excess.argmax())
    if float(excess[worst]) > 0:
        return (f"the part is not the published combination of the inputs received (class {worst}: off by "
                f"{float((result_sketch - combined)[worst]):.3g}, its rounding allows {float(allowance[worst]):.3g})")
    return ""


def _check_auto_tau(claim: PartClaim, weights: Sequence[float], tau_scale: float, eps: float) -> str:
    """An automatic radius no larger than CenteredClip lets it be (a reducer that inflates it would
    leave its accomplices' inputs unclipped): `RADIUS_BOUND * tau_scale` times the (lower) median
    of the contributors' published distances from the part (plus the codec's rounding `eps`), or
    robust.py's fallback of 1 when a median's worth of inputs are one (identical sketches)."""
    active = [i for i, w in enumerate(weights) if w > 0]
    if len(active) <= 2:
        limit = 1.0  # the median distance from the medoid of one or two inputs is the medoid's own 0
    else:
        k = (len(active) - 1) // 2
        spread = sorted(claim.distances[i] for i in active)[k]
        limit = RADIUS_BOUND * tau_scale * (spread + eps) * (1 + CLIP_RTOL)
        if claim.tau == 1.0 and _a_median_are_one(claim.sketches[active], k + 1):
            limit = max(limit, 1.0)  # robust.py's radius when the median distance from the medoid is 0
    if claim.tau > limit:
        return f"clipping radius {claim.tau:.4g} exceeds what the inputs' spread allows ({limit:.4g})"
    return ""


def _a_median_are_one(sketches: torch.Tensor, count: int) -> bool:
    """Whether at least `count` of the inputs have the same sketches (to float64 rounding)."""
    for row in sketches:
        same = ((sketches - row).abs().amax(dim=1) <= 1e-12 * float(row.abs().max()) + 1e-300).sum()
        if int(same) >= count:
            return True
    return False


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


__all__ = ["CLASSES", "SKETCHES", "PartClaim", "ReducerLied", "Verdict", "check_part",
           "input_distances", "part_digest", "projections", "rounding_bound", "rounding_bounds", "sketch"]
