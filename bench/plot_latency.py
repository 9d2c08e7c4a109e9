#!/usr/bin/env python3
"""Latency percentile curves (HdrHistogram style) as a PNG, standard library only.

    python3 bench/plot_latency.py latency.csv latency.png [title]

The CSV has the columns system,percentile,latency_ms (what bench/peers.py
writes). The x axis is the percentile on a log scale of 1/(1-p) (50%, 90%,
99%, 99.9%, ...), the y axis the latency in ms on a log scale. The PNG is
drawn here pixel by pixel (a 5x7 bitmap font, zlib + struct for the file),
so no plotting package is needed.
"""
import csv
import math
import struct
import sys
import zlib

# 5x7 glyphs: seven rows, bit 4 is the leftmost column.
FONT = {
    '0': (0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E), '1': (0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E),
    '2': (0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F), '3': (0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E),
    '4': (0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02), '5': (0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E),
    '6': (0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E), '7': (0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08),
    '8': (0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E), '9': (0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C),
    'A': (0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11), 'B': (0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E),
    'C': (0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E), 'D': (0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C),
    'E': (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F), 'F': (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10),
    'G': (0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F), 'H': (0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11),
    'I': (0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E), 'J': (0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C),
    'K': (0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11), 'L': (0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F),
    'M': (0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11), 'N': (0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11),
    'O': (0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E), 'P': (0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10),
    'Q': (0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D), 'R': (0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11),
    'S': (0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E), 'T': (0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04),
    'U': (0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E), 'V': (0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04),
    'W': (0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A), 'X': (0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11),
    'Y': (0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04), 'Z': (0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F),
    '.': (0, 0, 0, 0, 0, 0x0C, 0x0C), '-': (0, 0, 0, 0x1F, 0, 0, 0),
    '%': (0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03), '(': (0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02),
    ')': (0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08), '/': (0, 0x01, 0x02, 0x04, 0x08, 0x10, 0),
    ':': (0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0), ',': (0, 0, 0, 0, 0x0C, 0x04, 0x08),
    '=': (0, 0, 0x1F, 0, 0x1F, 0, 0), ' ': (0, 0, 0, 0, 0, 0, 0),
}
COLORS = [(0xD6, 0x27, 0x28), (0x1F, 0x77, 0xB4), (0x2C, 0xA0, 0x2C), (0x94, 0x67, 0xBD)]


class Canvas:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray(b'\xff' * (w * h * 3))

    def dot(self, x, y, c):
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i:i + 3] = bytes(c)

    def rect(self, x0, y0, x1, y1, c):
        for y in range(max(0, y0), min(self.h, y1)):
            for x in range(max(0, x0), min(self.w, x1)):
                self.dot(x, y, c)

    def line(self, x0, y0, x1, y1, c, width=1):
        x0, y0, x1, y1 = int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1))
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        for _ in range(dx - dy + 1):  # Bresenham, bounded by the line's length
            for ox in range(width):
                for oy in range(width):
                    self.dot(x0 + ox, y0 + oy, c)
            if x0 == x1 and y0 == y1:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x, y, s, c=(0, 0, 0), scale=2):
        for ch in s.upper():
            rows = FONT.get(ch, FONT[' '])
            for r, bits in enumerate(rows):
                for col in range(5):
                    if bits & (0x10 >> col):
                        self.rect(x + col * scale, y + r * scale,
                                  x + (col + 1) * scale, y + (r + 1) * scale, c)
            x += 6 * scale

    def png(self, path):
        raw = b''.join(b'\x00' + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3])
                       for y in range(self.h))

        def chunk(kind, data):
            return (struct.pack('>I', len(data)) + kind + data
                    + struct.pack('>I', zlib.crc32(kind + data) & 0xFFFFFFFF))
        with open(path, 'wb') as f:
            f.write(b'\x89PNG\r\n\x1a\n')
            f.write(chunk(b'IHDR', struct.pack('>IIBBBBB', self.w, self.h, 8, 2, 0, 0, 0)))
            f.write(chunk(b'IDAT', zlib.compress(raw, 9)))
            f.write(chunk(b'IEND', b''))


def text_width(s, scale=2):
    return len(s) * 6 * scale


def plot(curves, path, title):
    """curves: {system: [(percentile, latency_ms), ...]}"""
    W, H = 900, 560
    left, right, top, bottom = 110, 60, 80, 90
    c = Canvas(W, H)
    pw, ph = W - left - right, H - top - bottom
    XMAX = 5.0  # up to 99.999%

    def xpos(p):
        p = min(p, 100.0)
        x = XMAX if p >= 100.0 else min(XMAX, math.log10(100.0 / (100.0 - p)))
        return left + x / XMAX * pw
    values = [ms for pts in curves.values() for _, ms in pts if ms and ms > 0]
    lo = 10 ** math.floor(math.log10(min(values))) if values else 0.1
    hi = 10 ** math.ceil(math.log10(max(values))) if values else 1000
    if hi <= lo:
        hi = lo * 10

    def ypos(ms):
        ms = max(ms, lo)
        return top + ph - (math.log10(ms) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * ph
    grid, axis = (0xDD, 0xDD, 0xDD), (0x33, 0x33, 0x33)
    decade = lo
    while decade <= hi * 1.0001:
        y = ypos(decade)
        c.line(left, y, left + pw, y, grid)
        label = ('%g' % decade)
        c.text(left - 10 - text_width(label), int(y) - 7, label)
        decade *= 10
    for x, label in [(0, '0%'), (0.30103, '50%'), (1, '90%'), (2, '99%'), (3, '99.9%'),
                     (4, '99.99%'), (5, '99.999%')]:
        px = left + x / XMAX * pw
        c.line(px, top, px, top + ph, grid)
        c.text(int(px) - text_width(label) // 2, top + ph + 10, label)
    c.line(left, top, left, top + ph, axis, 2)
    c.line(left, top + ph, left + pw, top + ph, axis, 2)
    c.text(left + pw // 2 - text_width('percentile') // 2, top + ph + 40, 'percentile')
    c.text(10, top - 26, "latency ms (log)")
    c.text(left + pw // 2 - text_width(title) // 2, 15, title)
    for i, (system, pts) in enumerate(curves.items()):
        color = COLORS[i % len(COLORS)]
        pts = [(p, ms) for p, ms in pts if ms is not None and ms == ms and ms > 0]
        for (p0, m0), (p1, m1) in zip(pts, pts[1:]):
            c.line(xpos(p0), ypos(m0), xpos(p1), ypos(m1), color, 3)
    # The legend in the lower right corner (the curves rise to the right,
    # so it is the emptiest), on a white box.
    lw = 70 + max((text_width(s) for s in curves), default=0)
    lx, ly = left + pw - lw - 10, top + ph - 24 * len(curves) - 14
    c.rect(lx - 8, ly - 8, lx + lw, top + ph - 4, (0xFF, 0xFF, 0xFF))
    for i, system in enumerate(curves):
        color = COLORS[i % len(COLORS)]
        c.rect(lx, ly + 3 + 24 * i, lx + 30, ly + 9 + 24 * i, color)
        c.text(lx + 40, ly + 24 * i, system)
    c.png(path)


def read_csv(path):
    curves = {}
    with open(path, newline='') as f:
        for row in csv.DictReader(f):
            try:
                ms = float(row['latency_ms'])
            except ValueError:
                continue
            curves.setdefault(row['system'], []).append((float(row['percentile']), ms))
    return curves


if __name__ == '__main__':
    if len(sys.argv) < 3:
        sys.exit('usage: plot_latency.py latency.csv latency.png [title]')
    plot(read_csv(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else 'fan-out latency')
