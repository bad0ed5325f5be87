"""The demo across restarts: its loss curve kept in the run's checkpoints, read back on `--resume-from`.

The first trainer saves the run's checkpoints (`swarm.Optimizer(checkpoint=...)`) and keeps in
each manifest's ``extra`` its loss curve so far (`RunCurve`): the run's seconds of training, its
smoothed training loss and its held-out evaluations, on the run's own time axis. A demo started
again with ``--resume-from DIR`` reads the newest checkpoint's curve: the launcher draws it before
the new points, and the trainers' new points continue its time axis, so the plot shows one curve
across the stop. Points after the checkpoint's moment are not in it, as the training they
describe is not either: the swarm resumes from that checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from swarm.checkpoint import CheckpointStore, RunCheckpointError

logger = logging.getLogger(__name__)

EXTRA_KEY = "demo_curve"
MAX_POINTS = 5000
"""Points kept per series (the oldest are thinned out beyond it): the manifest stays small."""


@dataclass
class RunCurve:
    """A run's loss curve across restarts.

    Attributes:
        elapsed: seconds of training before this start (the new points' time offset).
        curves: smoothed training loss by trainer name, as ``[seconds, loss]`` pairs.
        evals: held-out losses as ``[seconds, loss]`` pairs.
    """

    elapsed: float = 0.0
    curves: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    evals: list[tuple[float, float]] = field(default_factory=list)

    def add(self, name: str, seconds: float, loss: float) -> None:
        _append(self.curves.setdefault(name, []), seconds, loss)

    def add_eval(self, seconds: float, loss: float) -> None:
        _append(self.evals, seconds, loss)

    def to_extra(self, elapsed: float) -> dict[str, object]:
        """The manifest's ``extra`` entry at `elapsed` seconds of the run."""
        return {EXTRA_KEY: {"elapsed": elapsed, "curves": {n: [list(p) for p in c] for n, c in self.curves.items()},
                            "evals": [list(p) for p in self.evals]}}

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> RunCurve:
        """The curve in a manifest's ``extra`` (empty when absent or malformed: a plot is no reason to fail)."""
        doc = extra.get(EXTRA_KEY)
        try:
            if not isinstance(doc, dict):
                return cls()
            curves = {str(n): [(float(t), float(v)) for t, v in points] for n, points in doc["curves"].items()}
            evals = [(float(t), float(v)) for t, v in doc["evals"]]
            return cls(float(doc["elapsed"]), curves, evals)
        except (KeyError, TypeError, ValueError, AttributeError):
            logger.warning("the checkpoint's loss curve is malformed: the plot starts afresh")
            return cls()


def _append(points: list[tuple[float, float]], seconds: float, loss: float) -> None:
    points.append((seconds, loss))
    if len(points) > MAX_POINTS:
        del points[1::2]


def prior_curve(directory: str | Path, run_id: str | None = None) -> RunCurve:
    """The curve kept in the newest verified checkpoint of `directory` (empty if there is none)."""
    try:
        checkpoint = CheckpointStore(directory).load_newest(run_id)
    except RunCheckpointError as e:
        logger.info("no loss curve to continue: %s", e)
        return RunCurve()
    return RunCurve.from_extra(checkpoint.manifest.extra)
