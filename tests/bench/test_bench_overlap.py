"""scripts/bench/bench_overlap.py: each phase counted against the plain runs on either side of it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_overlap.py"

pytestmark = pytest.mark.timeout(60)


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_overlap", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_phase_is_counted_against_the_mean_of_the_plain_runs_just_before_and_after_it() -> None:
    bench = load()
    plains = [(40.0, 2.0), (44.0, 2.2), (42.0, 2.1)]  # plain, phase a, plain, phase b, plain
    ratios = bench.bracketed({"a": (39.9, 2.1, 0), "b": (34.44, 2.247, 1)}, plains)
    assert ratios["a"] == pytest.approx((39.9 / 42.0, 2.1 / 2.1))
    assert ratios["b"] == pytest.approx((34.44 / 43.0, 2.247 / 2.15))


def test_the_two_ways_of_bracketing_the_baseline_do_not_combine() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--plain-again", "--plain-between"], check=False,
                         capture_output=True, text=True, timeout=50)
    assert run.returncode == 2
    assert "not allowed with argument" in run.stderr


def test_a_phase_is_judged_against_the_issues_goals_on_its_unrounded_ratios() -> None:
    bench = load()
    assert bench.verdict(0.94, 1.041) == "both goals met"
    assert bench.verdict(0.9, 1.05) == "both goals met"  # the goals' own values meet them
    # 0.8996 prints as 0.90x and 1.0504 as 1.050x: the verdict still says they missed, and by what
    assert bench.verdict(0.8996, 1.03) == "goal missed: samples/s 0.8996x < 0.9x"
    assert bench.verdict(0.95, 1.0504) == "goal missed: held-out loss 1.0504x > 1.05x"
    assert bench.verdict(0.88, 1.07) == "goal missed: samples/s 0.8800x < 0.9x; held-out loss 1.0700x > 1.05x"
