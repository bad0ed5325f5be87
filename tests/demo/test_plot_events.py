"""The loss plot, the events trainers print, and the board the launcher draws."""

from __future__ import annotations

import io
import struct
import sys

import pytest

from swarm.demo.display import Board
from swarm.demo.events import Evaluation, Notice, Progress, TextSample, from_json, printable, to_json
from swarm.demo.plot import BLACK, PALETTE, PlotUnavailable, Series, plot


def test_plot_writes_a_png_of_the_requested_size_showing_every_series():
    pytest.importorskip("matplotlib", reason="the plot needs the demo extra (matplotlib)")
    from matplotlib.image import imread

    series = [Series("trainer-0", [(t, 5.0 - t / 30) for t in range(60)], PALETTE[0]),
              Series("held-out", [(0, 5.5), (30, 4.0)], BLACK, dots=True)]
    data = plot(series, "time (s)", "loss", width=320, height=200)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    width, height = struct.unpack(">II", data[16:24])
    assert (kind, length, width, height) == (b"IHDR", 13, 320, 200)
    pixels = {tuple(round(float(c) * 255) for c in px[:3]) for row in imread(io.BytesIO(data)) for px in row}
    assert PALETTE[0] in pixels and BLACK in pixels


def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
    for name in ("matplotlib", "matplotlib.figure"):  # what the import meets where matplotlib is absent
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(PlotUnavailable, match=r"swarm-peer\[demo\]"):
        plot([Series("t", [(0, 1.0)], BLACK)], "x", "y")


def test_events_round_trip_and_garbage_is_ignored():
    events = [Progress("t", 1.0, 2, 3.5, 10.0, 3, 4, 32, 100, 200), Evaluation("t", 5.0, 2.5),
              TextSample("t", "after", "The ", "end"), Notice("t", "hello")]
    assert [from_json(to_json(e)) for e in events] == events
    assert from_json("Traceback (most recent call last):") is None
    assert from_json('{"kind": "nope"}') is None
    assert printable("a\nb\ufffd\x07") == "a⏎b·"


def test_board_prints_snapshots_when_not_on_a_terminal():
    out = io.StringIO()
    board = Board(["trainer-0", "trainer-1"], duration=60, stream=out, plain_interval=0)
    board.update(Progress("trainer-0", 1.0, 2, 3.5, 10.0, 2, 4, 32, 1_000_000, 2_000_000))
    board.draw()
    text = out.getvalue()
    assert "\x1b[" not in text
    assert "trainer-0  loss  3.500" in text and "trainer-1  starting" in text and "3.0 MB" in text
