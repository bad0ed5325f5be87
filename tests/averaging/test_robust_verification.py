"""A member's checks of a part (swarm/averaging/verification.py) and the leader's verdict, without sockets."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.averaging.group import GroupInfo, MemberInfo
from swarm.averaging.robust import centered_clip
from swarm.averaging.verification import (
    CLASSES,
    Z_SIGNS,
    PartClaim,
    Verdict,
    check_part,
    input_distances,
    part_digest,
    rounding_bound,
    rounding_bounds,
    sign_classes,
    sketch,
)
from swarm.compression import get_codec
from swarm.proto import averaging_pb2

ROUND = b"r" * 16


def _inputs(n=5, size=3000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(size, generator=gen)
    xs = [base + 0.1 * torch.randn(size, generator=gen) for _ in range(n)]
    xs[-1] = xs[-1] * 1000  # a byzantine contributor
    return xs


def _roundtrip(codec, x):
    """`x` as a peer receives it under `codec` (a CompressionType value; 0: as is)."""
    out = x.clone()
    if codec:
        c = get_codec(codec)
        c.decode(c.encode(x), out)
    return out


def _honest_claim(xs, weights, result=None, part=0):
    out = torch.empty_like(xs[0])
    outcome = centered_clip(xs, weights, out)
    values = out if result is None else result
    digest = part_digest(values)
    return PartClaim(digest, outcome.scales, outcome.tau, outcome.step, sketch(xs, ROUND, part, digest), input_distances(xs, values)), values


def _check(claim, values, xs, me, weights, tau=None):
    return check_part(claim, values, xs[me], me, list(range(len(xs))), weights, ROUND, 0, True, tau)


def test_an_honest_part_passes_every_member_check():
    xs, w = _inputs(), [1.0] * 5
    claim, values = _honest_claim(xs, w)
    for me in range(5):
        assert _check(claim, values, xs, me, w) == ""


def test_a_shifted_result_fails_the_linear_check():
    xs, w = _inputs(), [1.0] * 5
    claim, values = _honest_claim(xs, w)
    lie = values + 0.01
    digest = part_digest(lie)
    forged = PartClaim(digest, claim.scales, claim.tau, claim.step, sketch(xs, ROUND, 0, digest), input_distances(xs, lie))
    assert "not the published combination" in _check(forged, lie, xs, 0, w)
    assert "digest" in _check(claim, lie, xs, 0, w)  # the old digest with new values


def test_a_substituted_input_is_caught_by_its_owner():
    xs, w = _inputs(), [1.0] * 5
    fake = list(xs)
    fake[1] = xs[1] + 1.0  # the reducer pretends member 1 sent something else
    claim, values = _honest_claim(fake, w)
    assert "not what this member sent" in _check(claim, values, xs, 1, w)
    assert _check(claim, values, xs, 2, w) == ""  # only the owner can tell


def test_over_clipping_an_honest_member_is_caught_by_it():
    xs, w = _inputs(), [1.0] * 5
    claim, values = _honest_claim(xs, w)
    scales = list(claim.scales)
    scales[2] = 0.1
    forged = PartClaim(claim.digest, tuple(scales), claim.tau, claim.step, claim.sketches, claim.distances)
    reason = _check(forged, values, xs, 2, w)
    assert "clipped to 0.1" in reason or "not the published combination" in reason


def test_a_reducer_that_leaves_its_own_outlier_unclipped_is_caught():
    xs, w = _inputs(), [1.0] * 5  # member 4 (the reducer, say) sends x1000
    claim, _ = _honest_claim(xs, w)
    scales = list(claim.scales)
    scales[4] = 1.0
    pulls = torch.tensor(scales, dtype=torch.float64)
    result = sum(float(p) * x for p, x in zip(pulls / pulls.sum(), xs)).float()
    digest = part_digest(result)
    forged = PartClaim(digest, tuple(scales), claim.tau, claim.step, sketch(xs, ROUND, 0, digest), input_distances(xs, result))
    assert "input pulls the part" in _check(forged, result, xs, 0, w)


def test_an_absolute_radius_must_be_the_agreed_one():
    xs, w = _inputs(), [1.0] * 5
    out = torch.empty_like(xs[0])
    outcome = centered_clip(xs, w, out, tau=5.0)
    digest = part_digest(out)
    claim = PartClaim(digest, outcome.scales, outcome.tau, outcome.step, sketch(xs, ROUND, 0, digest), input_distances(xs, out))
    assert _check(claim, out, xs, 0, w, tau=5.0) == ""
    assert "instead of the agreed" in _check(claim, out, xs, 0, w, tau=4.0)


def test_a_malformed_claim_is_refused():
    header = averaging_pb2.ResultHeader(sketches=[1.0, 2.0])
    try:
        PartClaim.from_header(header, 3)
    except ValueError as e:
        assert "sketch values" in str(e)
    else:
        raise AssertionError("accepted")


def _group(n=4):
    members = tuple(MemberInfo(f"peer{i}", f"/ip4/127.0.0.1/tcp/{1000 + i}") for i in range(n))
    return GroupInfo(ROUND, "t", members, numel=100, timeout=10.0)


def _verdict(reports, expected=(0, 1, 2, 3)):
    async def run():
        v = Verdict(_group(), lambda: frozenset(expected), asyncio.get_running_loop().time() + 1.0)
        answers = await asyncio.gather(*(v.submit(r) for r in reports))
        assert all(a == answers[0] for a in answers)  # one verdict for everyone
        return answers[0]

    return asyncio.run(run())


def _report(member, digests, accused=(), reasons=()):
    return averaging_pb2.VerifyReport(member=member, digests=digests, accused=list(accused), reasons=list(reasons))


def test_verdict_ok_when_every_member_holds_the_same_parts():
    d = [b"a", b"b", b"c", b"d"]
    assert _verdict([_report(i, d) for i in range(4)]).ok


def test_verdict_names_an_equivocating_reducer_and_an_accused_one():
    d = [b"a", b"b", b"c", b"d"]
    other = [b"a", b"b", b"X", b"d"]
    verdict = _verdict([_report(0, d), _report(1, d), _report(2, other), _report(3, d)])
    assert not verdict.ok and verdict.accused == 2 and verdict.reported_by == 2 and "equivocation" in verdict.reason
    verdict = _verdict([_report(0, d), _report(1, d, [3], ["part 3: lie"]), _report(2, d), _report(3, d)])
    assert not verdict.ok and verdict.accused == 3 and verdict.reported_by == 1


def test_verdict_does_not_wait_past_its_time_for_a_missing_member():
    d = [b"a", b"b", b"c", b"d"]
    assert _verdict([_report(i, d) for i in range(3)]).ok


def test_verdict_waits_only_its_grace_after_the_first_report():
    async def run():
        loop = asyncio.get_running_loop()
        v = Verdict(_group(), lambda: frozenset(range(4)), loop.time() + 60.0, grace=0.2)
        d = [b"a", b"b", b"c", b"d"]
        started = loop.time()
        answers = await asyncio.wait_for(asyncio.gather(*(v.submit(_report(i, d)) for i in range(3))), 10.0)
        return answers, loop.time() - started

    answers, took = asyncio.run(run())
    assert all(a.ok for a in answers) and took < 30.0  # not the 60 s of `until`


def test_a_reducer_grinding_a_two_coordinate_lie_through_the_sketches_rarely_succeeds():
    # The blind spot of sign projections: moving mass d between coordinates a and b changes
    # <r, result> by d * (r_a - r_b), zero whenever the two signs agree. A reducer can retry such
    # a lie under new digests (new vectors) until every sketch agrees at a and b: with SKETCHES
    # vectors, 2**-SKETCHES of its tries pass (1 in 256; it was 1 in 16 with four vectors).
    xs, w = _inputs(), [1.0] * 5
    _, values = _honest_claim(xs, w)
    outcome = centered_clip(xs, w, torch.empty_like(xs[0]))
    passed = 0
    for attempt in range(128):
        lie = values.clone()
        shift = 0.5 + attempt / 128
        lie[7] += shift
        lie[2024] -= shift
        digest = part_digest(lie)
        forged = PartClaim(digest, outcome.scales, outcome.tau, outcome.step, sketch(xs, ROUND, 0, digest), input_distances(xs, lie))
        passed += _check(forged, lie, xs, 0, w) == ""
    assert passed <= 3, f"{passed} of 128 forged parts passed"


def test_under_a_4_bit_codec_a_two_coordinate_lie_within_the_projections_allowance_is_caught_in_its_classes():
    # UNIFORM_4BIT rounds each element by up to half a step of its block's range: summed over
    # 4096 elements that is far more than a two-coordinate move, so the projections (allowed 7
    # times all of it) cannot see the move. Each class holds ~1/256 of the coordinates: the move
    # meets only its own classes' rounding there, and no honest rounding fails it.
    UNIFORM_4BIT, chunk = 5, 1 << 18
    xs, w = [_roundtrip(UNIFORM_4BIT, x) for x in _inputs(n=4, size=4096)[:3]], [1.0] * 3  # three honest inputs as received
    out = torch.empty_like(xs[0])
    outcome = centered_clip(xs, w, out)
    values = _roundtrip(UNIFORM_4BIT, out)
    contributors = list(range(3))

    def check(values, me, round_id=ROUND):
        digest = part_digest(values)
        claim = PartClaim(digest, outcome.scales, outcome.tau, outcome.step, sketch(xs, round_id, 0, digest),
                          input_distances(xs, values))
        assert claim.sketches.shape == (3, CLASSES)
        return check_part(claim, values, xs[me], me, contributors, w, round_id, 0, True, None, UNIFORM_4BIT, 1.0, chunk)

    for r in range(20):  # the honest part under twenty rounds' classes passes every member
        assert [check(values, me, bytes([r]) * 16) for me in contributors] == ["", "", ""]
    shift = 4 * float(values.square().mean().sqrt())  # 4 times the part's RMS at each of two coordinates
    assert 2 * shift < Z_SIGNS * rounding_bound(values, UNIFORM_4BIT, chunk) / 4  # far inside the projections' allowance
    caught = 0
    for a, b in ((7, 2024), (100, 3000), (1, 4095), (512, 513), (2048, 9)):
        lie = values.clone()
        lie[a] += shift
        lie[b] -= shift
        reason = check(lie, 1)
        caught += reason.startswith("the part is not the published combination of the inputs received (class")
    assert caught == 5


def _awkward(shape, size, gen):
    """Values that the codecs round in their corner cases (see the tests below)."""
    if shape == "near_constant":  # within 0.3% of one value: one QUANTILE_8BIT grid cell
        return 1 + 0.0029 * torch.rand(size, generator=gen)
    if shape == "subnormal_steps":  # a uniform step below float32's normal range
        return torch.arange(size, dtype=torch.float32) % 300 * 1e-40
    if shape == "constant":
        return torch.full((size,), 0.7)
    if shape == "zeros":
        return torch.zeros(size)
    return torch.cat([torch.randn(size // 2, generator=gen), torch.rand(size - size // 2, generator=gen) * 1e-39])


AWKWARD = ["near_constant", "subnormal_steps", "constant", "zeros", "tiny_and_large"]


@pytest.mark.parametrize("codec", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("shape", AWKWARD)
def test_the_rounding_bounds_hold_where_the_codecs_round_in_their_corner_cases(codec, shape):
    # Whatever float32 result a reducer encodes, the bounds members compute from the decoded
    # values alone must hold: the L2 norm of the rounding, and its summed absolute values per
    # class. The corners: a block within 0.3% of one value (QUANTILE_8BIT puts it in one float16
    # cell: one level with no neighbour, each element up to ~2**-8 off); uniform steps below
    # float32's normal range (UNIFORM_4BIT's inverse step is inf, UNIFORM_8BIT's stored step
    # loses bits); constants and zeros; subnormals beside normal values.
    gen = torch.Generator().manual_seed(codec)
    chunk = 1 << 18
    for size in (5000, 256, 300):
        result = _awkward(shape, size, gen)
        decoded = _roundtrip(codec, result)
        error = (decoded.double() - result.double()).abs()
        classes = sign_classes(size, ROUND, 0, part_digest(decoded))
        eps, per_class = rounding_bounds(decoded, codec, chunk, classes)
        assert float(torch.linalg.vector_norm(error)) <= eps, (size, eps)
        assert bool((torch.bincount(classes, weights=error, minlength=CLASSES) <= per_class).all()), size


@pytest.mark.parametrize("codec", [0, 1, 3, 4, 5])
@pytest.mark.parametrize("shape", AWKWARD)
def test_an_honest_part_of_awkward_inputs_passes_every_member(codec, shape):
    # The same values as three contributors' inputs, through the whole check: CenteredClip's
    # float32 distances of subnormal inputs underflowed to 0, so it took the fallback radius 1
    # that members (summing in float64) refused; it now sums such small norms in float64.
    gen = torch.Generator().manual_seed(codec)
    chunk = 1 << 18
    base = _awkward(shape, 5000, gen)
    xs = [_roundtrip(codec, base * (1 + 1e-4 * i) + 1e-41 * i) for i in range(3)]
    w = [1.0, 1.0, 1.0]
    out = torch.empty_like(xs[0])
    outcome = centered_clip(xs, w, out)
    values = _roundtrip(codec, out)
    digest = part_digest(values)
    claim = PartClaim(digest, outcome.scales, outcome.tau, outcome.step, sketch(xs, ROUND, 0, digest),
                      input_distances(xs, values))
    for me in range(3):
        assert check_part(claim, values, xs[me], me, [0, 1, 2], w, ROUND, 0, True, None, codec, 1.0, chunk) == ""


def test_an_inflated_automatic_radius_is_caught_and_an_honest_one_passes_across_seeds():
    # With tau=None members cannot recompute the radius (it is the median distance of inputs
    # they do not see from their medoid); they bound it from the sketches. A reducer that
    # inflates it (here: an honest CenteredClip run with ten times the radius, so scales and
    # combination are consistent) would let its accomplices' inputs through unclipped.
    w = [1.0] * 5
    for seed in range(40):
        xs = _inputs(seed=seed)
        claim, values = _honest_claim(xs, w)
        assert all(_check(claim, values, xs, me, w) == "" for me in range(5)), seed
    xs = _inputs(seed=3)
    honest = centered_clip(xs, w, torch.empty_like(xs[0]))
    out = torch.empty_like(xs[0])
    inflated = centered_clip(xs, w, out, tau=10 * honest.tau)
    digest = part_digest(out)
    forged = PartClaim(digest, inflated.scales, inflated.tau, inflated.step, sketch(xs, ROUND, 0, digest), input_distances(xs, out))
    for me in range(4):  # every honest member catches it (the attacker, member 4, is unclipped now)
        assert "exceeds what the inputs' spread allows" in _check(forged, out, xs, me, w), me


def test_the_automatic_radius_of_two_small_inputs_is_the_fallback_and_passes():
    # two contributors: the median distance from the medoid is the medoid's own 0, so the
    # reducer falls back to tau = 1, far above these small inputs' spread
    gen = torch.Generator().manual_seed(1)
    xs = [1e-3 * torch.randn(3000, generator=gen) for _ in range(2)]
    claim, values = _honest_claim(xs, [1.0, 1.0])
    assert claim.tau == 1.0
    for me in range(2):
        assert _check(claim, values, xs, me, [1.0, 1.0]) == ""


def test_the_own_distance_and_a_distance_understated_for_the_pull_check_are_caught():
    xs, w = _inputs(), [1.0] * 5
    claim, values = _honest_claim(xs, w)
    distances = list(claim.distances)
    distances[1] *= 1.01  # the reducer misstates what member 1's input is from the part
    forged = PartClaim(claim.digest, claim.scales, claim.tau, claim.step, claim.sketches, tuple(distances))
    assert "distance from the part published" in _check(forged, values, xs, 1, w)
    # its own x1000 input, unclipped, with its distance understated to pass the pull bound
    scales = list(claim.scales)
    scales[4] = 1.0
    pulls = torch.tensor(scales, dtype=torch.float64)
    result = sum(float(p) * x for p, x in zip(pulls / pulls.sum(), xs)).float()
    digest = part_digest(result)
    distances = input_distances(xs, result)
    distances[4] = distances[0]
    forged = PartClaim(digest, tuple(scales), claim.tau, claim.step, sketch(xs, ROUND, 0, digest), tuple(distances))
    assert "farther from the part than published" in _check(forged, result, xs, 0, w)


def test_a_radius_inflated_by_overstating_honest_distances_is_caught_by_their_owners():
    xs, w = _inputs(), [1.0] * 5
    claim, values = _honest_claim(xs, w)
    distances = tuple(d * (1 if i == 4 else 4) for i, d in enumerate(claim.distances))
    forged = PartClaim(claim.digest, claim.scales, 4 * claim.tau, claim.step, claim.sketches, distances)
    for me in range(4):
        assert "distance from the part published" in _check(forged, values, xs, me, w)


def test_a_majority_of_identical_inputs_allows_the_fallback_radius_and_nothing_else_does():
    # robust.py's radius is 1 when the median distance from the medoid is 0: a median's worth
    # of inputs are one. Members see it in the sketches; a radius of 1 over spread inputs fails.
    gen = torch.Generator().manual_seed(2)
    base = 1e-3 * torch.randn(3000, generator=gen)
    xs = [base.clone() for _ in range(3)] + [base + 1e-3 * torch.randn(3000, generator=gen) for _ in range(2)]
    w = [1.0] * 5
    claim, values = _honest_claim(xs, w)
    assert claim.tau == 1.0
    assert all(_check(claim, values, xs, me, w) == "" for me in range(5))
    spread = [base + 1e-3 * torch.randn(3000, generator=gen) for _ in range(5)]
    honest, values = _honest_claim(spread, w)
    forged = PartClaim(honest.digest, honest.scales, 1.0, honest.step, honest.sketches, honest.distances)
    assert "exceeds what the inputs' spread allows" in _check(forged, values, spread, 0, w)
