"""One trace as a waterfall (an SVG in a small HTML page), drawn from the spans an OTLP receiver
got: a row per span, indented under its parent, a bar from its start to its end, coloured by
what it was (the attempt that answered green, the one that lost red, a failed one amber), its
events as marks. The tracing tests screenshot it (and docs/observability.md shows one)."""

from __future__ import annotations

import html

from tests.otlp_receiver import Span

WIDTH = 1200
LABEL_W = 430  # the span names' column
RIGHT_W = 90  # the durations' column
ROW_H = 30
BAR_H = 18
TOP = 84
COLORS = {
    "SERVER": "#334155",
    "INTERNAL": "#94a3b8",
    "answered": "#16a34a",
    "won": "#16a34a",
    "lost": "#dc2626",
    "failed": "#f59e0b",
    "CLIENT": "#2563eb",
}
LEGEND = (
    ("server span", "SERVER"),
    ("step", "INTERNAL"),
    ("attempt that answered", "won"),
    ("attempt that lost the race", "lost"),
    ("failed attempt", "failed"),
)


def _color(span: Span) -> str:
    if span.kind != "CLIENT" or span.name.startswith("summarize "):
        return COLORS.get(span.kind, COLORS["INTERNAL"])
    outcome = span.attributes.get("tokenpipe.attempt.outcome")
    if outcome in ("answered", "won", "lost"):
        return COLORS[str(outcome)]
    return COLORS["failed"] if span.status == 2 else COLORS["CLIENT"]


def _order(spans: list[Span]) -> list[tuple[Span, int]]:
    """Depth-first from the root, children by start time: (span, depth)."""
    ids = {s.span_id for s in spans}
    kids: dict[str, list[Span]] = {}
    for s in spans:
        kids.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    out: list[tuple[Span, int]] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(kids.get(parent, []), key=lambda s: s.start):
            out.append((s, depth))
            walk(s.span_id, depth + 1)

    walk("", 0)
    return out


def _label(span: Span) -> str:
    a = span.attributes
    parts = [span.name]
    if "tokenpipe.upstream.name" in a and span.kind == "CLIENT":
        parts.append(f"{a['tokenpipe.upstream.name']} · {a.get('tokenpipe.attempt.role', '')}")
        if "tokenpipe.attempt.outcome" in a:
            parts.append(str(a["tokenpipe.attempt.outcome"]))
    return " — ".join(parts)


def render(spans: list[Span], title: str) -> tuple[str, dict[str, tuple[int, int, int, int]], str]:
    """(the page, each span's bar as (x, y, w, h) in page pixels by span id, its size as
    "WIDTH,HEIGHT" for the screenshot)."""
    rows = _order(spans)
    t0 = min(s.start for s in spans)
    t1 = max(s.end for s in spans)
    scale = (WIDTH - LABEL_W - RIGHT_W - 20) / max(1, t1 - t0)
    height = TOP + ROW_H * len(rows) + 70
    boxes: dict[str, tuple[int, int, int, int]] = {}
    out: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="DejaVu Sans, sans-serif" font-size="13">',
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        f'<text x="16" y="28" font-size="17" font-weight="bold">{html.escape(title)}</text>',
        f'<text x="16" y="50" fill="#475569">trace {spans[0].trace_id} · '
        f"{(t1 - t0) / 1e6:.1f} ms · {len(spans)} spans</text>",
    ]
    for ms in _ticks((t1 - t0) / 1e6):
        x = LABEL_W + ms * 1e6 * scale
        out.append(
            f'<line x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{TOP + ROW_H * len(rows)}" '
            'stroke="#e2e8f0"/>'
            f'<text x="{x:.1f}" y="{TOP - 10}" fill="#64748b" font-size="11" '
            f'text-anchor="middle">{ms:g} ms</text>'
        )
    for i, (s, depth) in enumerate(rows):
        y = TOP + i * ROW_H
        x = LABEL_W + (s.start - t0) * scale
        w = max(2.0, (s.end - s.start) * scale)
        bar = (round(x), y + (ROW_H - BAR_H) // 2, round(w), BAR_H)
        boxes[s.span_id] = bar
        out.append(
            f'<text x="{16 + depth * 18}" y="{y + 19}">{html.escape(_label(s))}</text>'
            f'<rect x="{bar[0]}" y="{bar[1]}" width="{bar[2]}" height="{BAR_H}" rx="3" '
            f'fill="{_color(s)}"/>'
            f'<text x="{WIDTH - 16}" y="{y + 19}" text-anchor="end" fill="#334155">'
            f"{(s.end - s.start) / 1e6:.1f} ms</text>"
        )
        for name, at in s.event_times:
            if name != "first_token":
                continue
            ex = LABEL_W + (at - t0) * scale
            out.append(
                f'<path d="M{ex:.1f} {y + 3} l5 6 l-5 6 l-5 -6 z" fill="#0f172a">'
                f"<title>{html.escape(name)}</title></path>"
            )
    ly = TOP + ROW_H * len(rows) + 34
    lx = 16
    for text, key in LEGEND:
        out.append(
            f'<rect x="{lx}" y="{ly - 11}" width="14" height="14" rx="2" fill="{COLORS[key]}"/>'
            f'<text x="{lx + 20}" y="{ly}">{html.escape(text)}</text>'
        )
        lx += 40 + 8 * len(text)
    out.append(
        f'<path d="M{lx + 7} {ly - 12} l5 6 l-5 6 l-5 -6 z" fill="#0f172a"/>'
        f'<text x="{lx + 20}" y="{ly}">first token</text>'
    )
    out.append("</svg>")
    page = (
        '<!doctype html><html><head><meta charset="utf-8"><title>trace</title>'
        "<style>body{margin:0;background:#fff;overflow:hidden}</style></head><body>"
        + "".join(out)
        + "</body></html>"
    )
    return page, boxes, f"{WIDTH},{height}"


def _ticks(total_ms: float) -> list[float]:
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000) if total_ms / s <= 8)
    return [i * step for i in range(int(total_ms // step) + 1)]
