#!/usr/bin/env python
"""Benchmark: how often a member's checks of a part fail an honest reducer, and how often they catch a lie.

Runs the real checks (`swarm.averaging.verification.check_part`) on parts made the way a reducer
makes them (the inputs through the wire codec, `centered_clip`, the result through the codec,
`part_digest`, `sketch`, `input_distances`), without sockets:

1. honest parts (`--parts`): 2 to 16 contributors, every codec, 1 to 4096 coordinates per part,
   tight to very spread inputs, heavy tails, one honest outlier, a majority of identical inputs,
   scales from 1e-4 to 1e3, equal, uneven and zero weights, automatic and absolute radii. Each
   is checked by one member other than the reducer (the checks that do not involve the member's
   own input are the same for every member), and each draw of inputs is checked under `--signs`
   parts' sign vectors (what the estimates' randomness comes from). Reported: false accusations,
   by reason.
2. the lies the threat model lists (`--trials` each, docs/security.md): a shifted part, a
   substituted input, an over-clipped member, the reducer's own outlier left unclipped (with its
   true distance, and with its distance understated), an inflated automatic radius (x3, x10), a
   two-coordinate shift (one try against the sign vectors), a wrong digest, and overstated
   distances of honest members. Every member but the reducer checks; a lie is caught when one
   of them fails it. Reported: the detection rate; for the lies that change only what the reducer
   publishes, also both revisions' rates on the parts whose honest form the baseline passes (a
   check that refuses a part honest or not tells no lie from the truth there).

With `--baseline REV` (default: the checks before their slack was derived) the checks of that
revision of verification.py, loaded from git, run on the same parts and lies in the same
invocation (lies on fields that revision did not have are marked n/a).

    nice .venv/bin/python scripts/bench/bench_verification.py [--parts 100000] [--trials 2000] [--seed 0]
    .venv/bin/python scripts/bench/bench_verification.py --cost REV   # check_part's time per codec, against REV
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import subprocess
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from swarm.averaging import verification as new
from swarm.averaging.config import AllReduceConfig
from swarm.averaging.robust import RADIUS_BOUND, ClipOutcome, centered_clip
from swarm.compression import CompressionError, get_codec

BASELINE = "89795b9"  # the checks before their slack was derived
ROUND = b"bench-verification"
SIZES = (1, 3, 17, 256, 1000, 4096)
SCENARIOS = ("tight", "normal", "spread", "very_spread", "heavy", "outlier", "two_clusters", "line", "identical_majority",
             "all_equal")
# lies that leave the inputs as they were and change only what the reducer publishes: the part
# they were made from is their honest form
CLAIM_LIES = ("shift_1e-2", "shift_1e-3", "substitute", "over_clip", "two_coordinates", "wrong_digest")
ATTACKS = ("shift_1e-2", "shift_1e-3", "substitute", "over_clip", "own_outlier_unclipped",
           "own_outlier_distance_understated", "inflate_tau_x3", "inflate_tau_x10", "two_coordinates",
           "wrong_digest", "overstate_distances")
NEW_FIELDS = {"own_outlier_distance_understated", "overstate_distances"}  # lies on `distances`


@dataclass
class Part:
    """One part as a reducer made it, and what its members need to check it."""

    inputs: list[torch.Tensor]   # as the reducer decoded them
    weights: list[float]
    values: torch.Tensor         # the result as sent
    outcome: ClipOutcome
    digest: bytes
    sketches: torch.Tensor
    distances: list[float]
    codec: int
    chunk_numel: int
    tau: float | None            # the agreed absolute radius, or None (automatic)
    tau_scale: float
    reducer: int
    index: int


def _codec_roundtrip(x: torch.Tensor, codec: int, chunk_numel: int) -> torch.Tensor:
    if codec == 0:
        return x.clone()
    c = get_codec(codec)
    out = torch.empty_like(x)
    for a in range(0, x.numel(), chunk_numel):
        c.decode(c.encode(x[a:a + chunk_numel]), out[a:a + chunk_numel])
    return out


def _honest_inputs(gen: torch.Generator, n: int, size: int, scenario: str, scale: float) -> list[torch.Tensor]:
    def randn() -> torch.Tensor:
        return torch.randn(size, generator=gen)

    base = randn()
    if scenario == "tight":
        xs = [base + 1e-3 * randn() for _ in range(n)]
    elif scenario == "normal":
        xs = [base + 0.1 * randn() for _ in range(n)]
    elif scenario == "spread":
        xs = [base + randn() for _ in range(n)]
    elif scenario == "very_spread":
        xs = [base + 100 * randn() for _ in range(n)]
    elif scenario == "heavy":  # Student's t with 1.5 degrees of freedom, in the base and in the noise
        def t() -> torch.Tensor:
            chi = torch.distributions.Chi2(torch.tensor(1.5)).sample((size,))
            return randn() / torch.sqrt(chi / 1.5)
        base = t()
        xs = [base + 0.1 * t() for _ in range(n)]
    elif scenario == "outlier":  # one honest input far from the others
        xs = [base + 0.1 * randn() for _ in range(n)]
        xs[int(torch.randint(n, (1,), generator=gen))] += 30 * randn()
    elif scenario == "two_clusters":  # a bare majority in one place, the rest in another
        far = 3 * randn()
        xs = [base + 0.1 * randn() + (far if i < n // 2 else 0) for i in range(n)]
    elif scenario == "line":  # inputs spaced along one direction (peers at different stages of training)
        direction = randn()
        xs = [base + (i / n) * direction + 0.01 * randn() for i in range(n)]
    elif scenario == "identical_majority":  # most peers hold the same values (the last round's mean)
        xs = [base.clone() for _ in range(n)]
        for i in range(n // 2):
            xs[i] = base + 0.1 * randn()
    else:
        xs = [base.clone() for _ in range(n)]
    return [(scale * x).float() for x in xs]


def make_part(gen: torch.Generator, index: int) -> Part | None:
    """One honest part (None: the drawn codec cannot encode the drawn values, as a sender would fail)."""
    def pick(seq: tuple[Any, ...]) -> Any:
        return seq[int(torch.randint(len(seq), (1,), generator=gen))]

    def uniform() -> float:
        return float(torch.rand((), generator=gen))

    n = 2 + int(torch.randint(15, (1,), generator=gen))
    size = pick(SIZES)
    scenario = pick(SCENARIOS)
    scale = 10 ** (-4 + 7 * uniform())
    codec = int(torch.randint(6, (1,), generator=gen))
    chunk_numel = get_codec(codec).chunk_numel(pick((4096, 16384, 1 << 20)))
    r = uniform()
    if r < 0.6:
        weights = [1.0] * n
    elif r < 0.9:
        weights = [0.1 + 3 * uniform() for _ in range(n)]
    else:
        weights = [1.0] * n
        weights[int(torch.randint(n, (1,), generator=gen))] = 0.0
    tau_scale = 2.0 if uniform() < 0.1 else 1.0
    try:
        inputs = [_codec_roundtrip(x, codec, chunk_numel) for x in _honest_inputs(gen, n, size, scenario, scale)]
    except CompressionError:
        return None
    tau = None
    if uniform() < 0.2:  # an absolute radius, somewhere around the inputs' spread
        tau = float(torch.linalg.vector_norm(inputs[0] - inputs[-1])) * (0.1 + 2 * uniform()) + 1e-6
    reducer = int(torch.randint(n, (1,), generator=gen))
    return reduce(inputs, weights, codec, chunk_numel, tau, tau_scale, reducer, index)


def reduce(inputs: list[torch.Tensor], weights: list[float], codec: int, chunk_numel: int, tau: float | None,
           tau_scale: float, reducer: int, index: int, clip_tau: float | None = None) -> Part | None:
    """What a reducer computes and publishes (`reducer.combine_robust`, the codec, `publish_claim`).
    `clip_tau`: the radius it actually uses (a lie when it differs from the agreed one)."""
    cfg = AllReduceConfig(aggregation="centered_clip")
    out = torch.empty_like(inputs[0])
    outcome = centered_clip(inputs, weights, out, tau=clip_tau if clip_tau is not None else tau, tau_scale=tau_scale,
                            max_iterations=cfg.clip_iterations, tolerance=cfg.clip_tolerance)
    try:
        values = _codec_roundtrip(out, codec, chunk_numel)
    except CompressionError:
        return None
    return publish(inputs, weights, values, outcome, codec, chunk_numel, tau, tau_scale, reducer, index)


def publish(inputs: list[torch.Tensor], weights: list[float], values: torch.Tensor, outcome: ClipOutcome, codec: int,
            chunk_numel: int, tau: float | None, tau_scale: float, reducer: int, index: int) -> Part:
    digest = new.part_digest(values)
    return Part(inputs, weights, values, outcome, digest, new.sketch(inputs, ROUND, index, digest),
                new.input_distances(inputs, values), codec, chunk_numel, tau, tau_scale, reducer, index)


def combine(inputs: list[torch.Tensor], weights: list[float], scales: list[float]) -> torch.Tensor:
    """The result a reducer sends for the given clip scales (the published combination)."""
    pulls = [w * c for w, c in zip(weights, scales)]
    total = sum(pulls)
    out = torch.zeros_like(inputs[0])
    for x, p in zip(inputs, pulls):
        out.add_(x, alpha=p / total)
    return out


# -- checks: this revision's and the baseline's --------------------------------------------------


def load_baseline(rev: str) -> types.ModuleType | None:
    try:
        source = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:swarm/averaging/verification.py"],
                                capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        print(f"baseline {rev}: not available ({e}); only this revision's checks run")
        return None
    module = types.ModuleType("verification_baseline")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:swarm/averaging/verification.py", "exec"), module.__dict__)  # noqa: S102
    return module


def check_new(p: Part, me: int, scales: tuple[float, ...] | None = None, tau: float | None = None,
              step: float | None = None, sketches: torch.Tensor | None = None, distances: list[float] | None = None,
              values: torch.Tensor | None = None, digest: bytes | None = None, own: torch.Tensor | None = None) -> str:
    o = p.outcome
    claim = new.PartClaim(digest or p.digest, scales or o.scales, o.tau if tau is None else tau,
                          o.step if step is None else step, p.sketches if sketches is None else sketches,
                          tuple(p.distances if distances is None else distances))
    return new.check_part(claim, p.values if values is None else values, p.inputs[me] if own is None else own, me,
                          list(range(len(p.inputs))), p.weights, ROUND, p.index, True, p.tau, p.codec, p.tau_scale,
                          p.chunk_numel)


def check_old(old: types.ModuleType, p: Part, me: int, scales: tuple[float, ...] | None = None,
              tau: float | None = None, step: float | None = None, sketches: torch.Tensor | None = None,
              values: torch.Tensor | None = None, digest: bytes | None = None, own: torch.Tensor | None = None) -> str:
    o = p.outcome
    claim = old.PartClaim(digest or p.digest, scales or o.scales, o.tau if tau is None else tau,
                          o.step if step is None else step,
                          new.projections(p.sketches if sketches is None else sketches))  # its sketches: the projections
    return str(old.check_part(claim, p.values if values is None else values, p.inputs[me] if own is None else own, me,
                              list(range(len(p.inputs))), p.weights, ROUND, p.index, True, p.tau, p.codec,
                              p.tau_scale))


# -- lies ----------------------------------------------------------------------------------------

Check = Callable[..., str]


def _rms(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x)) / math.sqrt(max(1, x.numel())) + 1e-30


def attack(name: str, p: Part, gen: torch.Generator, check: Check, with_distances: bool) -> bool | None:
    """Whether some member other than the reducer catches the lie `name` told about part `p`
    (None: the lie does not apply to this part)."""
    n, r = len(p.inputs), p.reducer
    honest = [i for i in range(n) if i != r]
    kw: dict[str, Any] = {}
    part = p
    if name.startswith("shift"):  # the reducer adds a constant to its result (FaultPoint LIE)
        lie = p.values + float(name.split("_")[1]) * _rms(p.values)
        forged = publish(p.inputs, p.weights, lie, p.outcome, p.codec, p.chunk_numel, p.tau, p.tau_scale, r, p.index)
        part = forged
    elif name == "substitute":  # it pretends member `victim` sent something else, and uses that
        victim = honest[0]
        fake = list(p.inputs)
        fake[victim] = p.inputs[victim] + 1e-2 * _rms(p.inputs[victim]) * torch.randn(p.values.numel(), generator=gen)
        forged_part = reduce(fake, p.weights, 0, p.chunk_numel, p.tau, p.tau_scale, r, p.index)
        if forged_part is None:
            return None
        part = forged_part
        return any(check(part, i, own=p.inputs[i]) for i in honest)
    elif name == "over_clip":  # it clips an honest member's input ten times harder than its distance allows
        victim = honest[0]
        scales = list(p.outcome.scales)
        scales[victim] *= 0.1
        lie = combine(p.inputs, p.weights, scales)
        part = publish(p.inputs, p.weights, lie, p.outcome, 0, p.chunk_numel, p.tau, p.tau_scale, r, p.index)
        kw["scales"] = tuple(scales)
    elif name.startswith("own_outlier"):  # its own input x1000, left unclipped
        inputs = list(p.inputs)
        inputs[r] = inputs[r] * 1000 + 1000 * _rms(inputs[r])
        honest_part = reduce(inputs, p.weights, 0, p.chunk_numel, p.tau, p.tau_scale, r, p.index)
        if honest_part is None or honest_part.outcome.scales[r] >= 0.5:
            return None  # CenteredClip would not have clipped it much: nothing to hide
        scales = list(honest_part.outcome.scales)
        scales[r] = 1.0
        lie = combine(inputs, p.weights, scales)
        part = publish(inputs, p.weights, lie, honest_part.outcome, 0, p.chunk_numel, p.tau, p.tau_scale, r, p.index)
        kw["scales"] = tuple(scales)
        if name.endswith("understated"):
            if not with_distances:
                return None
            distances = list(part.distances)
            distances[r] = sorted(distances)[len(distances) // 2]
            kw["distances"] = distances
    elif name.startswith("inflate_tau"):  # its own input x1000, and a radius `factor` times the honest one
        if p.tau is not None or n < 3:
            return None
        factor = float(name.split("x")[1])
        inputs = list(p.inputs)
        inputs[r] = inputs[r] * 1000 + 1000 * _rms(inputs[r])
        honest_part = reduce(inputs, p.weights, 0, p.chunk_numel, None, p.tau_scale, r, p.index)
        if honest_part is None:
            return None
        forged = reduce(inputs, p.weights, 0, p.chunk_numel, None, p.tau_scale, r, p.index,
                        clip_tau=factor * honest_part.outcome.tau)
        if forged is None:
            return None
        part = forged
    elif name == "two_coordinates":  # mass moved between two coordinates, one try against the sign vectors
        if p.values.numel() < 2:
            return None
        lie = p.values.clone()
        a, b = torch.randperm(lie.numel(), generator=gen)[:2].tolist()
        shift = 10 * _rms(p.values)
        lie[a] += shift
        lie[b] -= shift
        part = publish(p.inputs, p.weights, lie, p.outcome, p.codec, p.chunk_numel, p.tau, p.tau_scale, r, p.index)
    elif name == "wrong_digest":
        kw["digest"] = bytes(16)
    elif name == "overstate_distances":  # honest members' distances x4, to allow a radius 4x as large
        if not with_distances:
            return None
        kw["distances"] = [d * (1 if i == r else 4) for i, d in enumerate(p.distances)]
        kw["tau"] = 4 * p.outcome.tau
    if not with_distances:
        kw.pop("distances", None)
    return any(check(part, i, **kw) for i in honest)


# -- the run ---------------------------------------------------------------------------------------


def _kind(reason: str) -> str:
    """A failure's reason without its numbers, to count alike ones together."""
    return re.sub(r"[-+]?\d[\d.]*(e[-+]?\d+)?", "#", reason.split(" (")[0])


def run(parts: int, trials: int, seed: int, baseline: str | None, signs: int = 4, by_codec: bool = False,
        out: Callable[[str], None] = print) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(seed)  # the heavy tails' chi-square draws
    old = load_baseline(baseline) if baseline else None
    gen = torch.Generator().manual_seed(seed)
    results: dict[str, Any] = {"parts": 0, "skipped": 0, "false_new": collections.Counter(),
                               "false_old": collections.Counter(), "ratios": [], "detected": {}}
    t0 = time.perf_counter()
    index = 0
    p: Part | None = None
    while results["parts"] < parts:
        index += 1
        if results["parts"] % signs == 0 or p is None:
            p = make_part(gen, index)
            if p is None:
                results["skipped"] += 1
                continue
        else:  # the same inputs under another round's sign vectors (the estimates' randomness)
            p = publish(p.inputs, p.weights, p.values, p.outcome, p.codec, p.chunk_numel, p.tau, p.tau_scale,
                        p.reducer, index)
        results["parts"] += 1
        me = (p.reducer + 1 + int(torch.randint(len(p.inputs) - 1, (1,), generator=gen))) % len(p.inputs)
        reason = check_new(p, me)
        if reason:
            results["false_new"][_kind(reason)] += 1
        if old is not None:
            reason = check_old(old, p, me)
            if reason:
                results["false_old"][_kind(reason)] += 1
        active = sorted(d for d, w in zip(p.distances, p.weights) if w > 0)
        if p.tau is None and len(active) > 2 and p.outcome.tau != 1.0 and results["parts"] % signs == 1:
            # what the check allows: the median distance plus the codec's rounding
            median = active[(len(active) - 1) // 2] + new.rounding_bound(p.values, p.codec, p.chunk_numel)
            results["ratios"].append(p.outcome.tau / p.tau_scale / median if median > 0 else math.inf)
    honest_seconds = time.perf_counter() - t0
    n_old = sum(results["false_old"].values())
    n_new = sum(results["false_new"].values())
    out(f"honest parts: {results['parts']} checked ({results['skipped']} draws skipped: the codec refuses the values), "
        f"{honest_seconds:.0f} s")
    out(f"honest parts falsely accused: this revision {n_new}" + (f", baseline {n_old}" if old else ""))
    for label, counter in (("this revision", results["false_new"]), ("baseline", results["false_old"])):
        for reason, count in counter.most_common():
            out(f"  {label}: {count} x {reason}")
    ratios = sorted(results["ratios"])
    if ratios:
        out(f"honest automatic radius / (median distance from the part + rounding): median {ratios[len(ratios) // 2]:.3f}, "
            f"max {ratios[-1]:.3f} over {len(ratios)} parts (allowed: {RADIUS_BOUND})")
    results["max_ratio"] = ratios[-1] if ratios else 0.0
    agen = torch.Generator().manual_seed(seed + 1)
    for name in ATTACKS:
        caught_new = caught_old = applied = 0
        # the baseline's catches of lies made from a part that it refuses honest too tell nothing
        # apart: counted separately (only for the lies that change nothing but the reducer's claim)
        caught_old_fair = caught_new_fair = refused_old_honest = 0
        tried = 0
        per_codec: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        while applied < trials and tried < 20 * trials:
            tried += 1
            p = make_part(agen, 10 ** 6 + tried)
            if p is None or len(p.inputs) < 3:
                continue
            state = agen.get_state()
            got_new = attack(name, p, agen, check_new, True)
            if got_new is None:
                continue
            applied += 1
            caught_new += got_new
            per_codec[p.codec][0] += 1
            per_codec[p.codec][1] += got_new
            if old is not None and name not in NEW_FIELDS:
                agen.set_state(state)  # the same lie, drawn from the same state
                got_old = bool(attack(name, p, agen, lambda q, i, **kw: check_old(old, q, i, **kw), False))
                caught_old += got_old
                per_codec[p.codec][2] += got_old
                if name in CLAIM_LIES:
                    refused = any(check_old(old, p, i) for i in range(len(p.inputs)) if i != p.reducer)
                    refused_old_honest += refused
                    caught_old_fair += got_old and not refused
                    caught_new_fair += got_new and not refused
        line = f"attack {name}: caught {caught_new}/{applied} ({100 * caught_new / max(1, applied):.1f}%)"
        if old is not None:
            line += (" baseline n/a (no such field)" if name in NEW_FIELDS
                     else f", baseline {caught_old}/{applied} ({100 * caught_old / max(1, applied):.1f}%)")
            if name in CLAIM_LIES and name not in NEW_FIELDS:
                fair = max(1, applied - refused_old_honest)
                line += (f"; on the {applied - refused_old_honest} parts whose honest form the baseline passes: "
                         f"{caught_new_fair} ({100 * caught_new_fair / fair:.1f}%), baseline {caught_old_fair} "
                         f"({100 * caught_old_fair / fair:.1f}%)")
        out(line)
        if by_codec:
            out("  by codec (caught, baseline, of): " + ", ".join(
                f"{c}: {v[1]}, {v[2]}, {v[0]}" for c, v in sorted(per_codec.items())))
        results["detected"][name] = (caught_new, caught_old, applied)
        results.setdefault("detected_fair", {})[name] = (caught_new_fair, caught_old_fair, applied - refused_old_honest)
    out(f"total {time.perf_counter() - t0:.0f} s")
    return results


def cost(baseline: str, numel: int = 1 << 22, contributors: int = 4, repeats: int = 3) -> None:
    """Time one member's `check_part` of an honest part per codec, against `baseline`'s checks
    in the same process (best of `repeats`)."""
    old = load_baseline(baseline)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(numel, generator=gen) for _ in range(contributors)]
    weights = [1.0] * contributors
    out = torch.empty(numel)
    outcome = centered_clip(inputs, weights, out)
    chunk = 1 << 18
    for codec in (0, 3, 4, 5):
        values = _codec_roundtrip(out, codec, chunk)
        digest = new.part_digest(values)
        line = f"codec {codec}: check_part of a {numel}-element part, {contributors} contributors:"
        for name, module in (("this revision", new), (baseline, old)):
            if module is None:
                continue
            claim = module.PartClaim(digest, outcome.scales, outcome.tau, outcome.step,
                                     module.sketch(inputs, ROUND, 0, digest), tuple(new.input_distances(inputs, values)))
            best = math.inf
            for _ in range(repeats):
                started = time.perf_counter()
                reason = module.check_part(claim, values, inputs[1], 1, list(range(contributors)), weights, ROUND, 0,
                                           True, None, codec, 1.0, chunk)
                best = min(best, time.perf_counter() - started)
            assert reason == "", (name, codec, reason)
            line += f" {name} {best * 1e3:.0f} ms"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", type=int, default=100_000, help="honest parts to check")
    ap.add_argument("--trials", type=int, default=2000, help="parts per lie")
    ap.add_argument("--signs", type=int, default=4, help="honest parts per draw of inputs (each under its own sign vectors)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--by-codec", action="store_true", help="detection rates per codec too")
    ap.add_argument("--baseline", default=BASELINE, help="git revision whose checks run beside ('' for none)")
    ap.add_argument("--cost", metavar="REV", help="instead: time check_part per codec against REV's checks")
    args = ap.parse_args()
    if args.cost:
        cost(args.cost)
        return
    run(args.parts, args.trials, args.seed, args.baseline or None, args.signs, args.by_codec,
        lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
