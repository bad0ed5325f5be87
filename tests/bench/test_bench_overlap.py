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
