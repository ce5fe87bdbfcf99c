"""The bench's `--html` report: one self-contained file (inline CSS and SVG, no network)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from tokenpipe.bench import svg
from tokenpipe.bench.load import RunResult
from tokenpipe.bench.metrics import SLO
from tokenpipe.bench.table import NO_SLO

#: Requests drawn per run in the timeline (the first ones sent): 60 rows in a 200-pixel
#: panel keep each bar ~2 px high; 300 rows of one run made the plot a single diagonal line.
TIMELINE_ROWS = 60
#: Runs drawn in the timeline (a panel each, 200 px); the rest is named in a note.
TIMELINE_RUNS = 12
PANEL_H = 200


def _cell(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _by_concurrency(runs: Sequence[RunResult], slo: SLO | None) -> dict[str, list]:
    """Series keyed by protocol (and temperature) with points per concurrency."""
    lat: dict[str, list[tuple[float, float]]] = {}
    tput: dict[str, list[tuple[float, float]]] = {}
    for run in runs:
        s = run.summary(slo).to_json()
        key = ",".join(run.protocols) + ("" if run.temperature is None else f" T={run.temperature}")
        for name, v in (
            (f"{key} TTFT p50", s["ttft_ms"]["p50"]),
            (f"{key} TTFT p99", s["ttft_ms"]["p99"]),
            (f"{key} e2e p50", s["e2e_ms"]["p50"]),
        ):
            if v is not None:
                lat.setdefault(name, []).append((run.concurrency, v))
        if s["output_tokens_per_s"] is not None:
            tput.setdefault(key, []).append((run.concurrency, s["output_tokens_per_s"]))
    return {"lat": list(lat.items()), "tput": list(tput.items())}


def names(runs: Sequence[RunResult]) -> list[str]:
    """One distinct name per run (a label seen twice, e.g. a repeated temperature, gets #2):
    series keyed by name would otherwise merge and one run would vanish from the plot."""
    out: list[str] = []
    for i, r in enumerate(runs):
        base = r.label or (f"run {i + 1}" if len(runs) > 1 else "run")
        name, n = base, 1
        while name in out:
            n += 1
            name = f"{base} #{n}"
        out.append(name)
    return out


def timeline(runs: Sequence[RunResult], run_names: Sequence[str]) -> str:
    """Small multiples: one panel per run, its first requests as rows over its own time."""
    panels: list[str] = []
    for run, name in list(zip(runs, run_names, strict=True))[:TIMELINE_RUNS]:
        origin = run.started_at
        recs = sorted(run.records, key=lambda r: r.sent_at)
        spans: list[tuple[str, float, float, str]] = []
        for rec in recs[:TIMELINE_ROWS]:
            label = f"#{rec.index}"
            start = (rec.sent_at - origin) * 1000
            end = ((rec.end_at or rec.sent_at) - origin) * 1000
            ft = rec.first_token_at
            if ft is None:
                spans.append((label, start, end, "#dc2626"))
                continue
            spans.append((label, start, (ft - origin) * 1000, "#9ca3af"))
            spans.append((label, (ft - origin) * 1000, end, "#2563eb"))
        shown = min(len(recs), TIMELINE_ROWS)
        panels.append(
            svg.bars(
                spans,
                f"{name}: {'first ' if shown < len(recs) else ''}{shown} of {len(recs)} requests",
                "ms since the run started",
                labels=False,
                height=PANEL_H,
                css_class="panel",
                plot_id=f"timeline-{len(panels)}",
            )
        )
    rest = len(runs) - len(panels)
    return svg.stack(
        panels,
        "Timeline per run (grey: waiting for the first token, blue: decoding, red: failed)",
        plot_id="plot-timeline",
        note=f"{rest} more runs not drawn" if rest > 0 else "",
    )


def render(
    runs: Sequence[RunResult],
    slo: SLO | None = None,
    title: str = "tokenpipe bench",
    command: str = "",
) -> str:
    rows = []
    for run in runs:
        s = run.summary(slo).to_json()
        rows.append(
            f"<tr><td>{escape(run.label or '-')}</td><td>{escape(','.join(run.protocols))}</td>"
            f"<td>{run.concurrency}</td><td>{s['requests_ok']}</td><td>{s['requests_failed']}</td>"
            f"<td>{_cell(s['ttft_ms']['p50'])}</td><td>{_cell(s['ttft_ms']['p99'])}</td>"
            f"<td>{_cell(s['itl_token_ms']['p50'], 2)}</td>"
            f"<td>{_cell(s['itl_token_ms']['p99'], 2)}</td>"
            f"<td>{_cell(s['itl_chunk_ms']['p50'], 2)}</td><td>{_cell(s['tpot_ms']['p50'], 2)}</td>"
            f"<td>{_cell(s['e2e_ms']['p50'])}</td><td>{_cell(s['e2e_ms']['p99'])}</td>"
            f"<td>{_cell(s['output_tokens_per_s'])}</td>"
            f"<td>{_cell(s['goodput'], 2) if slo else NO_SLO}</td></tr>"
        )
    notes = "".join(
        f'<p class="note">{escape(r.label)}: {escape(n)}</p>' for r in runs for n in r.notes
    )
    run_names = names(runs)
    ttft = {
        n: [x * 1000 for x in (rec.ttft for rec in r.records) if x is not None]
        for n, r in zip(run_names, runs, strict=True)
    }
    itl = {
        n: [g * 1000 for rec in r.records if rec.ok for g, _ in rec.itl_tokens()]
        for n, r in zip(run_names, runs, strict=True)
    }
    series = _by_concurrency(runs, slo)
    plots = [
        svg.histogram(ttft, "TTFT distribution", "ms", plot_id="plot-ttft"),
        svg.histogram(itl, "ITL per token distribution", "ms", plot_id="plot-itl"),
        svg.lines(
            dict(series["lat"]),
            "Latency vs concurrency",
            "concurrency",
            "ms",
            plot_id="plot-latency",
        ),
        svg.lines(
            dict(series["tput"]),
            "Throughput vs concurrency",
            "concurrency",
            "output tokens/s",
            plot_id="plot-throughput",
        ),
        timeline(runs, run_names)
        if runs
        else svg.bars([], "Timeline", "", plot_id="plot-timeline"),
    ]
    head = (
        "<th>run</th><th>protocol</th><th>conc</th><th>ok</th><th>failed</th>"
        "<th>TTFT p50</th><th>TTFT p99</th><th>ITL/tok p50</th><th>ITL/tok p99</th>"
        "<th>ITL/chunk p50</th><th>TPOT p50</th><th>e2e p50</th><th>e2e p99</th>"
        "<th>tokens/s</th><th>goodput req/s</th>"
    )
    slo_text = (
        f"<p>SLO: <code>{escape(str(slo.to_json()))}</code></p>"
        if slo
        else "<p>No SLO given (<code>--slo</code>): no goodput.</p>"
    )
    return (
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{escape(title)}</title>"
        f"<style>{svg.CSS}</style></head><body><h1>{escape(title)}</h1>"
        f"<p><code>{escape(command)}</code></p>{slo_text}"
        f"<table><tr>{head}</tr>{''.join(rows)}</table>"
        "<p>Times in ms. TTFT counts to the first content token (role-only chunks excluded); "
        "ITL per token is each chunk gap divided by the tokens in that chunk.</p>"
        f"{notes}<div class=plots>{''.join(plots)}</div>{svg.RENDER_CHECK}</body></html>"
    )
