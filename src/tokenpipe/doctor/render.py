"""The doctor's outputs: terminal text and the self-contained HTML page."""

from __future__ import annotations

import itertools
from html import escape

from rich.console import Console
from rich.table import Table

from tokenpipe.bench import svg
from tokenpipe.doctor import inside
from tokenpipe.doctor.findings import median_chunk_gap
from tokenpipe.doctor.run import DoctorReport, summary_line
from tokenpipe.doctor.trace import PHASES

_PHASE_COLORS = {
    "dns": "#9333ea",
    "connect": "#0891b2",
    "tls": "#0d9488",
    "request_sent": "#4b5563",
    "headers": "#ea580c",
    "first_token": "#dc2626",
    "decode": "#2563eb",
    "tail": "#16a34a",
}
_EXPLAIN = {
    "dns": "name lookup",
    "connect": "TCP handshake",
    "tls": "TLS handshake",
    "request_sent": "writing the request (and waiting for a pooled connection)",
    "headers": "server accepted the request and answered with headers",
    "first_token": "headers -> first content token (queue + prefill on the server)",
    "decode": "first -> last content token",
    "tail": "last token -> end of stream (usage, [DONE])",
}


#: Columns the "what it is" column keeps at least (its longest word is 11).
_EXPLAIN_MIN = 24
#: The waterfall bar's width in a wide terminal (characters).
_BAR_MAX = 40
_BAR_MIN = 10


def bar_width(console_width: int, name_w: int, ms_w: int) -> int:
    """The waterfall bar's width: 40 where there is room, less in a narrow terminal so the
    explanation keeps `_EXPLAIN_MIN` columns (4 columns: 13 of borders and padding)."""
    room = console_width - 13 - name_w - ms_w - _EXPLAIN_MIN
    return max(_BAR_MIN, min(_BAR_MAX, room))


def print_text(r: DoctorReport, console: Console | None = None) -> None:
    console = console or Console()
    ph = r.phases_ms
    total = sum(ph[k] for k in PHASES) or 1.0
    t = Table(
        title=f"waterfall of one request (the median of {len(r.traced)})", title_justify="left"
    )
    rows = [k for k in PHASES] + [k for k in ph if k.startswith("server_")]
    drawn = {row.spec.key: row for row in inside.rows(ph)}
    name_w = max(len(k) for k in rows)
    ms_w = max(len(f"{ph[k]:.1f}") for k in rows)
    width = bar_width(console.width, name_w, ms_w)
    t.add_column("phase", no_wrap=True)
    t.add_column("ms", justify="right", no_wrap=True)
    t.add_column("", no_wrap=True, width=width)
    # Wraps (folding a word only if it is longer than the column), never cut to "…".
    t.add_column("what it is", overflow="fold", min_width=_EXPLAIN_MIN)
    at = 0.0
    for k in PHASES:
        v = ph[k]
        start = int(at / total * width)
        n = min(width - start, max(1 if v > 0 else 0, int(v / total * width + 0.5)))
        t.add_row(k, f"{v:.1f}", " " * start + "\u2588" * n, _EXPLAIN[k])
        at += v
    for k, v in ph.items():
        if not k.startswith("server_"):
            continue
        explain = inside.EXPLAIN.get(k, "reported by the server")
        row = drawn.get(k)
        if row is None:
            t.add_row(k, f"{v:.1f}", "", explain)
            continue
        start = min(width - 1, int(row.start / total * width))
        n = min(width - start, max(1 if v > 0 else 0, int(v / total * width + 0.5)))
        t.add_row(k, f"{v:.1f}", " " * start + "\u2593" * n, explain)
    console.print(t)
    console.print(summary_line(r))
    if r.scaling is not None:
        console.print(f"output length: {r.scaling.evidence}")
    if r.hol is not None:
        console.print(
            f"shared-connection probe: {len(r.hol.records)} streams over {r.hol.transport}"
        )
        for note in r.hol.notes:
            console.print(f"  [yellow]note[/] {note}")
    if r.findings:
        console.print("[bold]findings[/]")
        for f in r.findings:
            console.print(f"  [red]{f.kind}[/]: {f.evidence}")
    else:
        console.print("[green]no findings[/]")
    for note in r.notes:
        console.print(f"[yellow]note[/] {note}")
    if r.profile_svg:
        console.print(f"flame graph: {r.profile_svg}")


def render_html(r: DoctorReport, command: str = "") -> str:
    ph = r.phases_ms
    spans = []
    at = 0.0
    for k in PHASES:
        spans.append((k, at, at + ph[k], _PHASE_COLORS[k]))
        at += ph[k]
    # The server's own phases (Server-Timing) below the client's, where they ran.
    spans += [(r.spec.label, r.start, r.end, r.spec.color) for r in inside.rows(ph)]
    plots = [
        svg.bars(
            spans,
            "Waterfall of one request"
            + (" (client phases, then the server's own)" if len(spans) > len(PHASES) else ""),
            "ms since the request started",
            plot_id="plot-waterfall",
            height=max(svg.H, 74 + 20 * len(spans)),
            label_rows=24,
        )
    ]
    if r.scaling is not None:
        fit = r.scaling.fit
        plots.append(
            svg.lines(
                {"requests": [(float(n), ms) for n, ms in r.sweep_points]},
                f"Latency vs output length (R\u00b2 {fit.r2:.4f})",
                "output tokens",
                "e2e ms",
                plot_id="plot-fit",
                fit=(fit.slope, fit.intercept),
                points_only=True,
            )
        )
    if r.hol is not None and r.hol.records:
        origin = min(x.sent_at for x in r.hol.records)
        med = median_chunk_gap(r.hol.records) or 0.0
        th = r.options.thresholds
        stall = max(th.stall_factor * med, th.stall_min_ms / 1000.0)
        hspans = []
        for rec in r.hol.records:
            label = f"stream {rec.index}"
            t = rec.chunk_times
            if not t:
                continue
            hspans.append((label, (rec.sent_at - origin) * 1000, (t[0] - origin) * 1000, "#9ca3af"))
            for a, b in itertools.pairwise(t):
                color = "#dc2626" if b - a > stall else "#2563eb"
                hspans.append((label, (a - origin) * 1000, (b - origin) * 1000, color))
        plots.append(
            svg.bars(
                hspans,
                f"{len(r.hol.records)} streams over {r.hol.transport} (red: stalls)",
                "ms since the first stream started",
                plot_id="plot-hol",
                labels=False,
            )
        )
    findings = (
        "".join(f"<li><b>{escape(f.kind)}</b>: {escape(f.evidence)}</li>" for f in r.findings)
        or "<li>none</li>"
    )
    rows = "".join(
        f"<tr><td>{escape(k)}</td><td>{v:.1f}</td>"
        f"<td class=w>{escape(_EXPLAIN.get(k) or inside.EXPLAIN.get(k, 'reported by the server'))}"
        "</td></tr>"
        for k, v in ph.items()
    )
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in r.notes)
    profile = (
        f'<p>Flame graph: <a href="{escape(r.profile_svg)}">{escape(r.profile_svg)}</a></p>'
        if r.profile_svg
        else ""
    )
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>tokenpipe doctor"
        f"</title><style>{svg.CSS}</style></head><body><h1>tokenpipe doctor</h1>"
        f"<p><code>{escape(command)}</code></p><p>{escape(summary_line(r))}</p>"
        f"<h2>Findings</h2><ul>{findings}</ul>{notes}"
        f"<h2>Phases (ms)</h2><table><tr><th>phase</th><th>ms</th><th>what it is</th></tr>"
        f"{rows}</table>{profile}<h2>Plots</h2><div class=plots>{''.join(plots)}</div>"
        f"{svg.RENDER_CHECK}</body></html>"
    )
