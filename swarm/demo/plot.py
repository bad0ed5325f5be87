"""A loss curve as a PNG, drawn with the standard library alone (zlib + struct).

The demo must run on a bare install, so instead of depending on matplotlib for one picture it
rasterizes a few polylines, axes with tick labels (a built-in 5x7 pixel font) and a legend into
an RGB buffer and writes it as a PNG (RFC 2083: signature, IHDR, one zlib IDAT, IEND).
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

Color = tuple[int, int, int]

PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
                              (140, 86, 75), (227, 119, 194), (127, 127, 127))
BLACK: Color = (0, 0, 0)
GRID: Color = (225, 225, 225)
WHITE: Color = (255, 255, 255)

# 5x7 glyphs: 7 rows of 5 columns per character ('#' = ink)
_GLYPHS: dict[str, tuple[str, ...]] = {
    '0': (' ### ', '#   #', '#  ##', '# # #', '##  #', '#   #', ' ### '),
    '1': ('  #  ', ' ##  ', '  #  ', '  #  ', '  #  ', '  #  ', ' ### '),
    '2': (' ### ', '#   #', '    #', '   # ', '  #  ', ' #   ', '#####'),
    '3': ('#####', '   # ', '  #  ', '   # ', '    #', '#   #', ' ### '),
    '4': ('   # ', '  ## ', ' # # ', '#  # ', '#####', '   # ', '   # '),
    '5': ('#####', '#    ', '#### ', '    #', '    #', '#   #', ' ### '),
    '6': ('  ## ', ' #   ', '#    ', '#### ', '#   #', '#   #', ' ### '),
    '7': ('#####', '    #', '   # ', '  #  ', ' #   ', ' #   ', ' #   '),
    '8': (' ### ', '#   #', '#   #', ' ### ', '#   #', '#   #', ' ### '),
    '9': (' ### ', '#   #', '#   #', ' ####', '    #', '   # ', ' ##  '),
    '.': ('     ', '     ', '     ', '     ', '     ', ' ##  ', ' ##  '),
    '-': ('     ', '     ', '     ', '#####', '     ', '     ', '     '),
    '(': ('   # ', '  #  ', ' #   ', ' #   ', ' #   ', '  #  ', '   # '),
    ')': (' #   ', '  #  ', '   # ', '   # ', '   # ', '  #  ', ' #   '),
    ':': ('     ', ' ##  ', ' ##  ', '     ', ' ##  ', ' ##  ', '     '),
    ' ': ('     ', '     ', '     ', '     ', '     ', '     ', '     '),
    'a': ('     ', '     ', ' ### ', '    #', ' ####', '#   #', ' ####'),
    'd': ('    #', '    #', ' ## #', '#  ##', '#   #', '#   #', ' ####'),
    'e': ('     ', '     ', ' ### ', '#   #', '#####', '#    ', ' ### '),
    'g': ('     ', ' ####', '#   #', '#   #', ' ####', '    #', ' ### '),
    'h': ('#    ', '#    ', '# ## ', '##  #', '#   #', '#   #', '#   #'),
    'i': ('  #  ', '     ', ' ##  ', '  #  ', '  #  ', '  #  ', ' ### '),
    'l': (' ##  ', '  #  ', '  #  ', '  #  ', '  #  ', '  #  ', ' ### '),
    'm': ('     ', '     ', '## # ', '# # #', '# # #', '#   #', '#   #'),
    'n': ('     ', '     ', '# ## ', '##  #', '#   #', '#   #', '#   #'),
    'o': ('     ', '     ', ' ### ', '#   #', '#   #', '#   #', ' ### '),
    'r': ('     ', '     ', '# ## ', '##  #', '#    ', '#    ', '#    '),
    's': ('     ', '     ', ' ####', '#    ', ' ### ', '    #', '#### '),
    't': ('  #  ', '  #  ', '#####', '  #  ', '  #  ', '  #  ', '   ##'),
    'u': ('     ', '     ', '#   #', '#   #', '#   #', '#  ##', ' ## #'),
    'c': ('     ', '     ', ' ### ', '#    ', '#    ', '#   #', ' ### '),
    'p': ('     ', '     ', '#### ', '#   #', '#### ', '#    ', '#    '),
    'k': ('#    ', '#    ', '#  # ', '# #  ', '##   ', '# #  ', '#  # '),
    'b': ('#    ', '#    ', '# ## ', '##  #', '#   #', '#   #', '#### '),
    'y': ('     ', '     ', '#   #', '#   #', ' ####', '    #', ' ### '),
    'f': ('  ## ', ' #  #', ' #   ', '###  ', ' #   ', ' #   ', ' #   '),
    'v': ('     ', '     ', '#   #', '#   #', '#   #', ' # # ', '  #  '),
    'x': ('     ', '     ', '#   #', ' # # ', '  #  ', ' # # ', '#   #'),
    '/': ('    #', '    #', '   # ', '  #  ', ' #   ', '#    ', '#    '),
    ',': ('     ', '     ', '     ', '     ', ' ##  ', '  #  ', ' #   '),
    'w': ('     ', '     ', '#   #', '#   #', '# # #', '# # #', ' # # '),
}


@dataclass(frozen=True)
class Series:
    """One curve: points (x, y), a label for the legend, and how to draw it."""

    label: str
    points: Sequence[tuple[float, float]]
    color: Color
    dots: bool = False


class Canvas:
    """An RGB image in memory."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def line(self, x0: float, y0: float, x1: float, y1: float, color: Color, width: int = 1) -> None:
        """Bresenham-style line by sampling, `width` pixels thick."""
        steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        half = width // 2
        for i in range(steps + 1):
            t = i / steps
            x, y = round(x0 + (x1 - x0) * t), round(y0 + (y1 - y0) * t)
            for dx in range(-half, width - half):
                for dy in range(-half, width - half):
                    self.set(x + dx, y + dy, color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(max(0, y0), min(self.height, y1)):
            for x in range(max(0, x0), min(self.width, x1)):
                self.set(x, y, color)

    def text(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = 1) -> int:
        """Draws `text` with its top-left at (x, y); returns the x after it. Unknown characters are blank."""
        for ch in text:
            glyph = _GLYPHS.get(ch, _GLYPHS[" "])
            for row, bits in enumerate(glyph):
                for col, bit in enumerate(bits):
                    if bit == "#":
                        self.rect(x + col * scale, y + row * scale, x + (col + 1) * scale, y + (row + 1) * scale,
                                  color)
            x += 6 * scale
        return x

    def png(self) -> bytes:
        """The image encoded as PNG (8-bit RGB, no filtering)."""
        raw = b"".join(b"\x00" + bytes(self.pixels[3 * y * self.width: 3 * (y + 1) * self.width])
                       for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + \
            chunk(b"IEND", b"")


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + 1e-9 * step:
        ticks.append(round(value, 10))
        value += step
    return ticks


def _label(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 or value == int(value) else f"{value:.1f}"


def plot(series: Sequence[Series], x_label: str, y_label: str, width: int = 800, height: int = 480) -> bytes:
    """Renders `series` on shared axes and returns the PNG bytes."""
    canvas = Canvas(width, height)
    left, right, top, bottom = 60, width - 170, 20, height - 45
    points = [p for s in series for p in s.points if math.isfinite(p[0]) and math.isfinite(p[1])]
    if not points:
        points = [(0.0, 0.0), (1.0, 1.0)]
    x_lo, x_hi = min(p[0] for p in points), max(p[0] for p in points)
    y_lo, y_hi = min(p[1] for p in points), max(p[1] for p in points)
    if x_hi <= x_lo:
        x_hi = x_lo + 1
    if y_hi <= y_lo:
        y_hi = y_lo + 1
    pad = 0.05 * (y_hi - y_lo)
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def sx(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * (right - left)

    def sy(y: float) -> float:
        return bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top)

    for tick in nice_ticks(x_lo, x_hi):
        canvas.line(sx(tick), top, sx(tick), bottom, GRID)
        text = _label(tick)
        canvas.text(round(sx(tick)) - 3 * len(text), bottom + 6, text)
    for tick in nice_ticks(y_lo, y_hi):
        canvas.line(left, sy(tick), right, sy(tick), GRID)
        text = _label(tick)
        canvas.text(left - 6 - 6 * len(text), round(sy(tick)) - 3, text)
    canvas.line(left, bottom, right, bottom, BLACK)
    canvas.line(left, top, left, bottom, BLACK)
    canvas.text((left + right) // 2 - 3 * len(x_label), bottom + 22, x_label)
    canvas.text(4, top - 14 if top >= 14 else 2, y_label)
    for i, s in enumerate(series):
        pts = [(sx(x), sy(y)) for x, y in s.points if math.isfinite(x) and math.isfinite(y)]
        if s.dots:
            for x, y in pts:
                canvas.rect(round(x) - 2, round(y) - 2, round(x) + 3, round(y) + 3, s.color)
        else:
            for (x0, y0), (x1, y1) in itertools.pairwise(pts):
                canvas.line(x0, y0, x1, y1, s.color, width=2)
        legend_y = top + 8 + 16 * i
        canvas.rect(right + 14, legend_y, right + 26, legend_y + 8, s.color)
        canvas.text(right + 32, legend_y, s.label)
    return canvas.png()
