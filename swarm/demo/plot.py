"""The demo's loss curve as a PNG, drawn with matplotlib (the `demo` extra: ``pip install 'swarm-peer[demo]'``).

scripts/demo.sh installs the extra. Without matplotlib `plot` raises `PlotUnavailable` (an
`ImportError` that says what to install) and the demo reports that instead of a picture.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BLACK", "PALETTE", "Color", "PlotUnavailable", "Series", "plot"]

Color = tuple[int, int, int]

PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
                              (140, 86, 75), (227, 119, 194), (127, 127, 127))
BLACK: Color = (0, 0, 0)
_DPI = 100


class PlotUnavailable(ImportError):
    """matplotlib is not installed, so there is no picture (the rest of the demo is unaffected)."""


@dataclass(frozen=True)
class Series:
    """One curve: (x, y) points in order, drawn as a line, or as dots when `dots`."""

    label: str
    points: Sequence[tuple[float, float]]
    color: Color
    dots: bool = False


def plot(series: Sequence[Series], x_label: str, y_label: str, width: int = 800, height: int = 480) -> bytes:
    """A PNG of `series` on shared axes with a legend, `width` x `height` pixels."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailable(
            "the loss plot needs matplotlib: pip install 'swarm-peer[demo]' (scripts/demo.sh does)") from e
    # A bare Figure (no pyplot): no global state, no GUI backend, safe from any thread.
    figure = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI)
    axes = figure.add_subplot()
    for s in series:
        xs = [x for x, _ in s.points]
        ys = [y for _, y in s.points]
        color = tuple(c / 255 for c in s.color)
        if s.dots:
            axes.plot(xs, ys, "o", color=color, markersize=4, label=s.label)
        else:
            axes.plot(xs, ys, "-", color=color, linewidth=1.5, label=s.label)
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.grid(True, color="#e1e1e1")
    if series:
        axes.legend(loc="upper right")
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=_DPI, metadata={"Software": None})
    return out.getvalue()
