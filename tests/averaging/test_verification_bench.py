"""The short run of scripts/bench/bench_verification.py: the real checks of a part, without sockets,
over honest parts of every kind and over the lies the threat model lists."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import bench_verification  # scripts/bench is no package

ALWAYS_CAUGHT = ("substitute", "over_clip", "own_outlier_unclipped", "own_outlier_distance_understated",
                 "wrong_digest", "overstate_distances")


@pytest.mark.timeout(120)
def test_no_honest_part_is_accused_and_the_listed_lies_are_caught():
    lines: list[str] = []
    results = bench_verification.run(parts=300, trials=8, seed=7, baseline=None, out=lines.append)
    assert results["parts"] == 300
    assert sum(results["false_new"].values()) == 0, lines
    assert results["max_ratio"] <= bench_verification.RADIUS_BOUND * (1 + 1e-4), lines
    for name in ALWAYS_CAUGHT:
        caught, _, applied = results["detected"][name]
        assert applied > 0 and caught == applied, (name, lines)
    caught, _, applied = results["detected"]["inflate_tau_x10"]
    assert applied > 0 and caught >= applied // 2, lines  # within the codec's rounding a lie passes
    # a two-coordinate move meets only its two classes' rounding: it passes when both coordinates
    # drew one byte (1 in 256), or where a coarse codec's rounding in those classes covers it
    caught, _, applied = results["detected"]["two_coordinates"]
    assert applied > 0 and caught >= applied - 1, lines
