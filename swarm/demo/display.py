"""The launcher's board: one live line per trainer plus a line for the whole swarm.

On a terminal the lines are redrawn in place (ANSI cursor movement); when stdout is a file or a
pipe, the board prints a snapshot every `plain_interval` seconds instead, so logs stay readable.
Notices (a trainer waiting for experts, a child that failed) are printed above the board.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from swarm.demo.events import Progress, format_progress, megabytes


class Board:
    """Keeps the latest progress of each trainer and draws it.

    Args:
        names: the trainers, in display order.
        duration: planned seconds of training (for the header).
        stream: where to draw (default stdout).
        plain_interval: seconds between snapshots when `stream` is not a terminal.
    """

    def __init__(self, names: list[str], duration: float, stream: TextIO | None = None,
                 plain_interval: float = 10.0) -> None:
        self.names = names
        self.duration = duration
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self.plain_interval = plain_interval
        self.latest: dict[str, Progress] = {}
        self.started = time.monotonic()
        self._drawn = 0
        self._last_plain = 0.0

    def update(self, progress: Progress) -> None:
        self.latest[progress.name] = progress

    def lines(self) -> list[str]:
        rows = [format_progress(self.latest[n]) if n in self.latest else f"{n:<10} starting..."
                for n in self.names]
        if self.latest:
            total = sum(p.samples_per_second for p in self.latest.values())
            epoch = max(p.epoch for p in self.latest.values())
            sent = sum(p.averaging_bytes + p.expert_bytes for p in self.latest.values())
            trained = max(p.elapsed for p in self.latest.values())
            header = (f"swarm      {trained:5.0f}/{self.duration:.0f} s | {total:6.1f} samples/s in all | "
                      f"epoch {epoch} | {megabytes(sent)} of tensors sent")
        else:
            header = f"swarm      starting the peers ({time.monotonic() - self.started:.0f} s)..."
        return [header, *rows]

    def draw(self, force: bool = False) -> None:
        """Redraws in place on a terminal; elsewhere prints a snapshot now and then (or when forced)."""
        lines = self.lines()
        if self.live:
            if self._drawn:
                self.stream.write(f"\x1b[{self._drawn}F")
            for line in lines:
                self.stream.write("\x1b[2K" + line + "\n")
            self._drawn = len(lines)
        else:
            now = time.monotonic()
            if not force and now - self._last_plain < self.plain_interval:
                return
            self._last_plain = now
            self.stream.write("\n".join(lines) + "\n\n")
        self.stream.flush()

    def notice(self, text: str) -> None:
        """Prints a message above the board (the board is redrawn below it)."""
        if self.live and self._drawn:
            self.stream.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0
        self.stream.write(text + "\n")
        if self.live:
            self.draw()
        self.stream.flush()
