"""A minimal PNG reader for screenshot checks (8-bit RGB/RGBA, not interlaced: what headless
Chromium writes), so the tests need no imaging library."""

from __future__ import annotations

import struct
import zlib


class Image:
    def __init__(self, width: int, height: int, channels: int, rows: list[bytes]) -> None:
        self.width, self.height, self.channels, self.rows = width, height, channels, rows

    def count(self, color: str, box: tuple[int, int, int, int], tolerance: int = 24) -> int:
        """Pixels within `tolerance` (per channel) of `#rrggbb` inside box (x, y, w, h)."""
        want = bytes.fromhex(color.lstrip("#"))
        x0, y0, w, h = box
        n = 0
        for y in range(max(0, y0), min(self.height, y0 + h)):
            row = self.rows[y]
            for x in range(max(0, x0), min(self.width, x0 + w)):
                p = row[x * self.channels : x * self.channels + 3]
                if all(abs(a - b) <= tolerance for a, b in zip(p, want, strict=True)):
                    n += 1
        return n


def read(data: bytes) -> Image:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    width = height = channels = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
            channels = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 255
        rows.append(bytes(line))
        prev = line
    return Image(width, height, channels, rows)
