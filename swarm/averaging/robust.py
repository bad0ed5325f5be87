"""Byzantine-robust aggregation of one part: CenteredClip around a robust centre.

Pure torch, no networking. The reducer of a part (`reducer`) calls `centered_clip` over the
agreed contributors' chunks of its part instead of taking their weighted mean.

CenteredClip (Karimireddy et al., "Learning from History for Byzantine Robust Optimization",
ICML 2021; used inside a butterfly all-reduce by Gorbunov et al., "Secure Distributed Training at
Scale", ICML 2022, Alg. 2 "BTARD") iterates

    v <- v + sum_i w_i c_i (x_i - v) / sum_i w_i,        c_i = min(1, tau / ||x_i - v||)

so an input far from the centre pulls it by at most `tau` (times its weight share), however far
it is. Here the centre starts at the weighted medoid, the input with the least weighted sum of
distances to the others (an honest one while honest inputs outweigh the rest and lie closer to
each other than to the attackers; unlike the mean, from which a x1000 input would take ~1000
iterations to walk back; and ten times cheaper than the coordinate median), the iteration stops
when a step moves the centre by less than `tolerance * tau` or after `max_iterations`, and the
result is one final re-weighting around the last centre:

    result = sum_i w_i c_i x_i / sum_i w_i c_i

which equals the fixed point when converged, and is *linear in the inputs with published
coefficients* (`ClipOutcome.coefficients`): what lets members check a reducer's result
(`verification`). It also gives the bound this module is tested against: `sum_i w_i c_i (x_i -
result) = 0` holds exactly, so if every honest input lies within `tau` of the last centre,

    ||result - honest weighted mean|| <= (W_byzantine / W_honest) * (tau + step)

where `step = ||result - last centre||` (`ClipOutcome.step`, at most `tolerance * tau` once
converged): each byzantine input, clipped to norm `tau` around the centre, moves the result by at
most its weight share of `tau`, whatever it sends (docs/architecture.md, "Robust averaging").

`tau`: an absolute radius, or (None) `tau_scale` times the median distance of the inputs from
the starting centre; the median of distances cannot be inflated by a minority of inputs. An
automatic radius is kept within `RADIUS_BOUND * tau_scale` times the median distance of the
inputs from the result, which members can check from the distances a reducer publishes
(`verification`; docs/security.md): where it is not (uneven weights placing the medoid far from
most inputs), the radius shrinks to that bound and CenteredClip runs again.
`coordinate_median` is kept as a robust reference for tests and benchmarks.

Fewer than `MIN_CONTRIBUTORS` inputs have no robust aggregate: of two, no rule that treats its
inputs alike can tell the liar from the honest one (it lands between them, where the liar
chooses), and one has nothing to compare against. `centered_clip` still computes them (the
radius falls back to 1.0, the median distance from the medoid being the medoid's own 0), but
averaging rounds never ask it to: robust mode forms groups of at least three and fails a round
whose decision keeps fewer contributors (docs/architecture.md, "Robust averaging", small groups).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_CONTRIBUTORS = 3  # fewest contributors a robust round aggregates (see above)
MEDIAN_COLUMNS = 1 << 15  # columns of the coordinate median computed at once (bounds its memory)
RADIUS_BOUND = 2.0  # an automatic radius is at most this times tau_scale times the median distance from the result
RADIUS_ROUNDS = 4   # CenteredClip runs again at most this many times to meet that bound


@dataclass(frozen=True)
class ClipOutcome:
    """What `centered_clip` did.

    Attributes:
        scales: per input, the clipping factor `c_i` in [0, 1] of the final re-weighting (1: not
            clipped; 0.01: its distance from the centre counted for 1%). Zero-weight inputs get 1.
        coefficients: per input, `w_i c_i / sum_j w_j c_j`: the result is `sum_i coefficients[i] * x_i`.
        tau: the clipping radius used.
        iterations: centre updates made.
        step: distance of the result from the last centre (small when converged).
        converged: the last update moved the centre by less than `tolerance * tau`.
    """

    scales: tuple[float, ...]
    coefficients: tuple[float, ...]
    tau: float
    iterations: int
    step: float
    converged: bool


def _check_inputs(inputs: Sequence[torch.Tensor], weights: Sequence[float]) -> int:
    if not inputs:
        raise ValueError("centered_clip needs at least one input")
    if len(weights) != len(inputs):
        raise ValueError(f"{len(inputs)} inputs but {len(weights)} weights")
    size = inputs[0].numel()
    for x in inputs:
        if x.dim() != 1 or x.numel() != size or x.dtype != torch.float32:
            raise ValueError("inputs must be 1-D float32 tensors of equal length")
    if any(not (math.isfinite(w) and w >= 0) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {list(weights)}")
    for x in inputs:
        if size and not bool(torch.isfinite(x).all()):
            raise ValueError("inputs must be finite (exclude non-finite contributions before aggregating)")
    return size


def coordinate_median(inputs: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise (lower) median of equal-length 1-D tensors, into `out`, a few columns at a time."""
    size = out.numel()
    for a in range(0, size, MEDIAN_COLUMNS):
        b = min(a + MEDIAN_COLUMNS, size)
        block = torch.stack([x[a:b] for x in inputs])
        out[a:b] = block.median(dim=0).values
    return out


def _norm(t: torch.Tensor) -> float:
    """The L2 norm of a float32 tensor, summed in float32 unless it is so small that its elements'
    squares may have underflowed (then in float64): a spread of 1e-36 is not 0, and members, who
    sum in float64, would take a radius or step computed as 0 for a lie."""
    norm = float(torch.linalg.vector_norm(t))
    return norm if norm >= 2.0 ** -50 else float(torch.linalg.vector_norm(t.double()))


def _distances(inputs: Sequence[torch.Tensor], centre: torch.Tensor, tmp: torch.Tensor) -> list[float]:
    out = []
    for x in inputs:
        torch.sub(x, centre, out=tmp)
        out.append(_norm(tmp))
    return out


def _medoid(xs: Sequence[torch.Tensor], ws: Sequence[float], tmp: torch.Tensor) -> int:
    """Index of the input with the least weighted sum of distances to the others (lowest on ties)."""
    n = len(xs)
    sums = [0.0] * n
    for i in range(n):
        for j in range(i + 1, n):
            torch.sub(xs[i], xs[j], out=tmp)
            d = float(torch.linalg.vector_norm(tmp))
            sums[i] += ws[j] * d
            sums[j] += ws[i] * d
    return min(range(n), key=lambda i: (sums[i], i))


def _scales(distances: Sequence[float], tau: float) -> list[float]:
    return [1.0 if d <= tau else tau / d for d in distances]


def centered_clip(
    inputs: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor, *, tau: float | None = None,
    tau_scale: float = 1.0, max_iterations: int = 20, tolerance: float = 1e-3,
) -> ClipOutcome:
    """CenteredClip of `inputs` (1-D float32, equal length, finite) with `weights`, into `out`.

    Args:
        inputs: the contributions (not modified).
        weights: one finite weight >= 0 per input, not all 0.
        out: receives the result (same length as the inputs; must not alias them).
        tau: clipping radius (> 0); None: `tau_scale` times the median distance from the start.
        tau_scale: see `tau`.
        max_iterations: bound on centre updates (>= 1).
        tolerance: stop when an update moves the centre by less than `tolerance * tau`.

    Returns:
        What was clipped, the coefficients of the result, the radius and the iterations.

    Raises:
        ValueError: no inputs, mismatched lengths, non-finite values or weights, bad settings.
    """
    size = _check_inputs(inputs, weights)
    if out.numel() != size or out.dtype != torch.float32:
        raise ValueError("out must be a float32 tensor as long as the inputs")
    if tau is not None and not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a finite number > 0, got {tau}")
    if not (math.isfinite(tau_scale) and tau_scale > 0) or max_iterations < 1 or not tolerance > 0:
        raise ValueError("need tau_scale > 0, max_iterations >= 1 and tolerance > 0")
    weights = [float(w) for w in weights]
    total = sum(weights)
    active = [i for i, w in enumerate(weights) if w > 0]
    xs = [inputs[i] for i in active]
    ws = [weights[i] for i in active]
    tmp = torch.empty(size, dtype=torch.float32)
    start = torch.empty(size, dtype=torch.float32)
    start.copy_(xs[_medoid(xs, ws, tmp)])
    if tau is not None:
        return _clip(inputs, active, xs, ws, total, start, tau, out, tmp, max_iterations, tolerance)
    spread = sorted(_distances(xs, start, tmp))[(len(xs) - 1) // 2]
    tau = tau_scale * spread if spread > 0 else 1.0  # a median's worth of inputs are one: any radius clips none
    outcome = _clip(inputs, active, xs, ws, total, start, tau, out, tmp, max_iterations, tolerance)
    if spread == 0:
        return outcome
    # The radius members can check (verification.py): at most RADIUS_BOUND * tau_scale times the
    # median distance of the inputs from the result. The medoid's median distance exceeds it only
    # where uneven weights put the medoid far from most inputs; then the radius shrinks to the
    # bound and CenteredClip runs again, a few times at most (the result moves towards most
    # inputs, so their distances shrink with the radius), and last with the bound as it stands.
    for attempt in range(RADIUS_ROUNDS):
        bound = RADIUS_BOUND * tau_scale * sorted(result_distances(xs, out))[(len(xs) - 1) // 2]
        if outcome.tau <= bound or bound <= 0:
            break
        outcome = _clip(inputs, active, xs, ws, total, start, bound * (1 - 1e-3), out, tmp, max_iterations, tolerance)
    return outcome


def result_distances(inputs: Sequence[torch.Tensor], result: torch.Tensor) -> list[float]:
    """Per input, its L2 distance from `result` (float32 differences summed in float64): the
    distances a reducer publishes and a member recomputes for its own input (`verification`)."""
    return [float(torch.linalg.vector_norm(torch.sub(x, result).double())) for x in inputs]


def _clip(
    inputs: Sequence[torch.Tensor], active: list[int], xs: list[torch.Tensor], ws: list[float], total: float,
    start: torch.Tensor, tau: float, out: torch.Tensor, tmp: torch.Tensor, max_iterations: int, tolerance: float,
) -> ClipOutcome:
    """CenteredClip from `start` with radius `tau` into `out` (see `centered_clip`)."""
    size = out.numel()
    centre = start.clone()
    distances = _distances(xs, centre, tmp)
    iterations, converged = 0, False
    following = torch.empty(size, dtype=torch.float32)
    while iterations < max_iterations and size:
        c = _scales(distances, tau)
        pull = sum(w * ci for w, ci in zip(ws, c))
        following.copy_(centre).mul_(1.0 - pull / total)
        for x, w, ci in zip(xs, ws, c):
            following.add_(x, alpha=w * ci / total)
        moved = float(torch.linalg.vector_norm(torch.sub(following, centre, out=tmp)))
        centre, following = following, centre
        iterations += 1
        distances = _distances(xs, centre, tmp)
        if moved <= tolerance * tau:
            converged = True
            break
    c = _scales(distances, tau)
    pull = sum(w * ci for w, ci in zip(ws, c))
    step = 0.0
    if size:
        if out.data_ptr() == centre.data_ptr():
            centre = centre.clone()
        out.zero_()
        for x, w, ci in zip(xs, ws, c):
            out.add_(x, alpha=w * ci / pull)
        step = _norm(torch.sub(out, centre, out=tmp))
    scales = [1.0] * len(inputs)
    coefficients = [0.0] * len(inputs)
    for i, ci, w in zip(active, c, ws):
        scales[i] = ci
        coefficients[i] = w * ci / pull
    return ClipOutcome(tuple(scales), tuple(coefficients), float(tau), iterations, step, converged)


def honest_bound(byzantine_weight: float, honest_weight: float, tau: float, step: float) -> float:
    """The bound above: how far the result may lie from the honest mean, given every honest input
    within `tau` of the last centre."""
    return byzantine_weight / honest_weight * (tau + step)


def too_few(contributors: int) -> str:
    """Why a robust round with `contributors` contributors cannot aggregate, or ""."""
    if contributors >= MIN_CONTRIBUTORS:
        return ""
    return (f"robust mode needs at least {MIN_CONTRIBUTORS} contributors, the decision keeps {contributors}: "
            "of two, nobody can tell the liar from the honest one")


__all__ = ["MIN_CONTRIBUTORS", "ClipOutcome", "centered_clip", "coordinate_median", "honest_bound", "too_few"]
