"""Small inline-SVG charts for the self-contained HTML reports (bench and doctor).

Hand-written because the reports must open offline with no CDN and no script: a plotting
library would either pull a JavaScript bundle (plotly, vega) or a heavy dependency
(matplotlib) for five kinds of chart that are a few dozen lines each.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape

W, H = 640, 300
PAD_L, PAD_R, PAD_T, PAD_B = 64, 16, 30, 44
#: About the width of one character of a bar's label (class "a", 10 px).
_LABEL_PX = 5.5
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563")


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * exp:
            return m * exp
    return 10 * exp


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.1f}"
    return f"{v:.2g}"


class _Frame:
    """Axes with linear scales; x0..x1, y0..y1 in data units."""

    def __init__(
        self,
        title: str,
        xlabel: str,
        ylabel: str,
        x1: float,
        y1: float,
        x0: float = 0.0,
        y0: float = 0.0,
        plot_id: str = "",
        h: int = H,
        css_class: str = "plot",
    ) -> None:
        self.x0, self.x1 = x0, x1 if x1 > x0 else x0 + 1
        self.y0, self.y1 = y0, y1 if y1 > y0 else y0 + 1
        self.h = h  # pixels: the frame's height (panels of a stack are shorter)
        self.parts: list[str] = [
            f'<svg class="{css_class}" id="{escape(plot_id)}" xmlns="http://www.w3.org/2000/svg" '
            f'viewBox="0 0 {W} {h}" width="{W}" height="{h}" role="img">',
            f"<title>{escape(title)}</title>",
            f'<text x="{W / 2}" y="18" text-anchor="middle" class="t">{escape(title)}</text>',
            f'<text x="{(PAD_L + W - PAD_R) / 2}" y="{h - 6}" text-anchor="middle" '
            f'class="l">{escape(xlabel)}</text>',
            f'<text x="14" y="{(PAD_T + h - PAD_B) / 2}" text-anchor="middle" class="l" '
            f'transform="rotate(-90 14 {(PAD_T + h - PAD_B) / 2})">{escape(ylabel)}</text>',
        ]
        for i in range(6):
            yv = self.y0 + (self.y1 - self.y0) * i / 5
            y = self.sy(yv)
            self.parts.append(
                f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y:.1f}" y2="{y:.1f}" '
                f'class="g"/><text x="{PAD_L - 4}" y="{y + 4:.1f}" '
                f'text-anchor="end" class="a">{_fmt(yv)}</text>'
            )
            xv = self.x0 + (self.x1 - self.x0) * i / 5
            x = self.sx(xv)
            self.parts.append(
                f'<text x="{x:.1f}" y="{h - PAD_B + 14}" text-anchor="middle" '
                f'class="a">{_fmt(xv)}</text>'
            )
        self.parts.append(
            f'<rect x="{PAD_L}" y="{PAD_T}" width="{W - PAD_L - PAD_R}" '
            f'height="{h - PAD_T - PAD_B}" class="f"/>'
        )

    def sx(self, v: float) -> float:
        return PAD_L + (v - self.x0) / (self.x1 - self.x0) * (W - PAD_L - PAD_R)

    def sy(self, v: float) -> float:
        h = self.h
        return h - PAD_B - (v - self.y0) / (self.y1 - self.y0) * (h - PAD_T - PAD_B)

    def add(self, s: str) -> None:
        self.parts.append(s)

    def legend(self, names: Sequence[str], colors: Sequence[str] = COLORS) -> None:
        for i, name in enumerate(names):
            y = PAD_T + 8 + 14 * i
            self.parts.append(
                f'<rect x="{W - PAD_R - 150}" y="{y - 8}" width="10" height="10" '
                f'fill="{colors[i % len(colors)]}"/><text x="{W - PAD_R - 136}" y="{y + 1}" '
                f'class="a">{escape(name)}</text>'
            )

    def render(self) -> str:
        return "".join(self.parts) + "</svg>"


def histogram(
    series: Mapping[str, Sequence[float]],
    title: str,
    xlabel: str,
    *,
    bins: int = 40,
    plot_id: str = "",
    clip_quantile: float = 0.99,
) -> str:
    """Overlaid histograms (share of samples per bin); the x range stops at the
    `clip_quantile` of all samples so one outlier does not squash the rest."""
    values = sorted(v for vs in series.values() for v in vs)
    if not values:
        return _empty(title, plot_id)
    hi = _nice_max(values[min(len(values) - 1, int(clip_quantile * len(values)))] * 1.05)
    lo = 0.0
    width = (hi - lo) / bins
    shares: dict[str, list[float]] = {}
    for name, vs in series.items():
        counts = [0] * bins
        for v in vs:
            counts[min(bins - 1, max(0, int((v - lo) / width)))] += 1
        total = max(1, len(vs))
        shares[name] = [c / total for c in counts]
    ymax = _nice_max(max((max(s) for s in shares.values() if s), default=1.0))
    f = _Frame(title, xlabel, "share of samples", hi, ymax, lo, plot_id=plot_id)
    # Each series is a step outline over a faint fill, not opaque bars: overlaid bars of
    # several runs hid one another. Earlier series are drawn wider (2 px more each, up to
    # 14), so where two runs' outlines coincide both colours still show.
    n = len(shares)
    for i, (name, s) in enumerate(shares.items()):
        color = COLORS[i % len(COLORS)]
        stroke = min(14, 2 + 2 * (n - 1 - i))
        pts = [f"{f.sx(lo):.1f},{f.sy(0):.1f}"]
        # The outline skips empty bins: a line along the axis would show a run's colour
        # where it has no samples.
        path: list[str] = []
        for b, share in enumerate(s):
            y, xl, xr = f.sy(share), f.sx(lo + b * width), f.sx(lo + (b + 1) * width)
            pts += [f"{xl:.1f},{y:.1f}", f"{xr:.1f},{y:.1f}"]
            if share <= 0:
                continue
            if b == 0 or s[b - 1] <= 0:
                path.append(f"M{xl:.1f},{f.sy(0):.1f}")
            path.append(f"L{xl:.1f},{y:.1f}L{xr:.1f},{y:.1f}")
            if b == len(s) - 1 or s[b + 1] <= 0:
                path.append(f"L{xr:.1f},{f.sy(0):.1f}")
        pts.append(f"{f.sx(hi):.1f},{f.sy(0):.1f}")
        f.add(
            f'<g class="series" data-series="{escape(name)}">'
            f'<polygon points="{" ".join(pts)}" fill="{color}" fill-opacity="0.12" '
            f'stroke="none"/><path d="{"".join(path)}" fill="none" stroke="{color}" '
            f'stroke-width="{stroke}" stroke-linejoin="round"/></g>'
        )
    if len(series) > 1:
        f.legend(list(series))
    return f.render()


def lines(
    series: Mapping[str, Sequence[tuple[float, float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    *,
    plot_id: str = "",
    fit: tuple[float, float] | None = None,
    points_only: bool = False,
) -> str:
    """Lines with markers per series; `fit` = (slope, intercept) draws a dashed fitted line."""
    pts = [p for s in series.values() for p in s]
    if not pts:
        return _empty(title, plot_id)
    xmax = _nice_max(max(x for x, _ in pts))
    ymax = _nice_max(max(y for _, y in pts) * 1.05)
    f = _Frame(title, xlabel, ylabel, xmax, ymax, plot_id=plot_id)
    for i, (_name, s) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        s = sorted(s)
        if not points_only and len(s) > 1:
            d = " ".join(f"{f.sx(x):.1f},{f.sy(y):.1f}" for x, y in s)
            f.add(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in s:
            f.add(f'<circle cx="{f.sx(x):.1f}" cy="{f.sy(y):.1f}" r="3" fill="{color}"/>')
    if fit is not None:
        slope, intercept = fit
        # Clip the line to the frame: it ends where it leaves the top edge.
        x_end = xmax if slope <= 0 else min(xmax, max(0.0, (ymax - intercept) / slope))
        f.add(
            f'<line x1="{f.sx(0):.1f}" y1="{f.sy(min(ymax, max(0.0, intercept))):.1f}" '
            f'x2="{f.sx(x_end):.1f}" '
            f'y2="{f.sy(min(ymax, max(0.0, intercept + slope * x_end))):.1f}" '
            f'stroke="#111" stroke-dasharray="5 4"/>'
        )
    if len(series) > 1 or fit is not None:
        colors = [COLORS[i % len(COLORS)] for i in range(len(series))] + ["#111"]
        f.legend([*series, *(["linear fit"] if fit else [])], colors)
    return f.render()


def bars(
    spans: Sequence[tuple[str, float, float, str]],
    title: str,
    xlabel: str,
    *,
    plot_id: str = "",
    max_rows: int = 400,
    labels: bool = True,
    height: int = H,
    css_class: str = "plot",
    label_rows: int = 16,
) -> str:
    """Horizontal spans (label, start, end, color), one row each: a timeline or a waterfall.
    Each span is labelled with its row and length when there are at most `label_rows` rows."""
    spans = list(spans)[:max_rows]
    if not spans:
        return _empty(title, plot_id, height, css_class)
    row_of = {label: i for i, label in enumerate(dict.fromkeys(lb for lb, *_ in spans))}
    n = max(1, len(row_of))
    xmax = _nice_max(max(e for _, _, e, _ in spans))
    f = _Frame(title, xlabel, "", xmax, float(n), plot_id=plot_id, h=height, css_class=css_class)
    h = max(1.0, (height - PAD_T - PAD_B) / n - 1)
    for label, start, end, color in spans:
        r = row_of[label]
        y = f.sy(n - r)
        f.add(
            f'<rect x="{f.sx(start):.1f}" y="{y:.1f}" '
            f'width="{max(0.8, f.sx(end) - f.sx(start)):.1f}" height="{h:.1f}" '
            f'fill="{color}" data-row="{escape(label)}">'
            f"<title>{escape(label)}: {start:.1f}-{end:.1f}</title></rect>"
        )
        if labels and n <= label_rows:
            text = f"{label} {end - start:.1f}"
            x, anchor = f.sx(end) + 4, ""
            # Past the right edge it would be cut off: before the bar instead, if it fits.
            if x + _LABEL_PX * len(text) > W and f.sx(start) - 4 > PAD_L + _LABEL_PX * len(text):
                x, anchor = f.sx(start) - 4, ' text-anchor="end"'
            f.add(
                f'<text x="{x:.1f}" y="{y + h / 2 + 4:.1f}" class="a"{anchor}>{escape(text)}</text>'
            )
    return f.render()


def stack(panels: Sequence[str], title: str, *, plot_id: str = "", note: str = "") -> str:
    """One plot of panels one above another (each an SVG of width W, e.g. `bars(...,
    css_class="panel")`): small multiples that count as one plot of the page."""
    heights = [int(p.split('height="', 1)[1].split('"', 1)[0]) for p in panels]
    top = 28
    total = top + sum(heights) + (18 if note else 0)
    out = [
        f'<svg class="plot" id="{escape(plot_id)}" xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {W} {total}" width="{W}" height="{total}" role="img">',
        f"<title>{escape(title)}</title>",
        f'<text x="{W / 2}" y="18" text-anchor="middle" class="t">{escape(title)}</text>',
    ]
    y = top
    for p, h in zip(panels, heights, strict=True):
        out.append(p.replace("<svg ", f'<svg x="0" y="{y}" ', 1))
        y += h
    if note:
        out.append(
            f'<text x="{W / 2}" y="{y + 12}" text-anchor="middle" class="l">{escape(note)}</text>'
        )
    return "".join(out) + "</svg>"


def _empty(title: str, plot_id: str, h: int = H, css_class: str = "plot") -> str:
    f = _Frame(title, "", "", 1.0, 1.0, plot_id=plot_id, h=h, css_class=css_class)
    f.add(f'<text x="{W / 2}" y="{h / 2}" text-anchor="middle" class="l">no data</text>')
    return f.render()


CSS = """
body{font:14px system-ui,sans-serif;margin:24px;color:#111;background:#fff}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;
text-align:right}th{background:#f3f4f6}td:first-child,th:first-child,td.w{text-align:left}
.plots{display:flex;flex-wrap:wrap;gap:12px}
svg.plot{border:1px solid #e5e7eb;background:#fff}
svg .t{font-size:14px;font-weight:600}svg .l{font-size:12px;fill:#374151}
svg .a{font-size:10px;fill:#4b5563}svg .g{stroke:#eee}svg .f{fill:none;stroke:#9ca3af}
.note{color:#92400e}.bad{color:#b91c1c}code{background:#f3f4f6;padding:1px 4px}
"""

#: Marks the page rendered: counts the plots into `data-plots` and writes where each plot and
#: panel landed into `data-boxes` ({id: [x, y, width, height]} in CSS pixels), for the
#: headless-browser tests that read the screenshot.
RENDER_CHECK = (
    "<script>document.body.dataset.plots="
    "String(document.querySelectorAll('svg.plot').length);"
    "const b={};for(const e of document.querySelectorAll('svg.plot,svg.panel')){"
    "const r=e.getBoundingClientRect();"
    "b[e.id]=[r.x+scrollX,r.y+scrollY,r.width,r.height].map(Math.round);}"
    "document.body.dataset.boxes=JSON.stringify(b);</script>"
)
