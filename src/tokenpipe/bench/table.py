"""The bench's terminal tables, laid out to fit the terminal.

One row per run needs ~185 columns for the full set of figures. Squeezed into an 80-column
terminal, rich cuts every cell to `…`, so `fit()` keeps the one-row-per-run layout only where it
fits at its natural width, and otherwise turns the table on its side: one row per figure, one
column per run, as many runs per table as fit (a sweep of many runs becomes several tables).
No cell is ever cut: `--wide` prints the full row layout at its natural width (lines as long
as they need to be, for a wide terminal or `less -S`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenpipe.bench.load import RunResult
from tokenpipe.bench.metrics import SLO

#: The text of a goodput cell without --slo: goodput is then every ok request, i.e. req/s
#: again, which would read as a measurement it is not.
NO_SLO = "no SLO"


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def fit(
    console: Console,
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    caption: str | None = None,
    wide: bool = False,
    left: frozenset[int] = frozenset({0}),
) -> None:
    """Print `rows` (first cell: the row's name) under `headers` as one table if it fits the
    console at its natural width (or `wide`), else transposed in as many tables as needed."""
    t = Table(title=title, title_justify="left", header_style="bold", caption=caption)
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i in left else "right", no_wrap=True)
    for r in rows:
        t.add_row(*r)
    natural = _natural(console, t)
    if natural <= console.width:
        console.print(t)
        return
    if wide:  # print(width=) clamps to the console's width: widen the console itself
        width = console.width
        console.width = natural
        try:
            console.print(t)
        finally:
            console.width = width
        return
    todo = list(rows)
    part = 1
    while todo:
        k = len(todo)
        while True:
            tt = _transposed(title, headers, todo[:k], left)
            if k == 1 or _natural(console, tt) <= console.width:
                break
            k -= 1
        if len(todo) > k or part > 1:
            tt.title = f"{title} ({part})"
        todo = todo[k:]
        if not todo and caption:
            tt.caption = caption
        console.print(tt)
        part += 1


def _natural(console: Console, t: Table) -> int:
    """Columns the table takes unsqueezed (`measure` alone clamps to the console's width)."""
    return console.measure(t, options=console.options.update_width(10_000)).maximum


def _transposed(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], left: frozenset[int]
) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    t.add_column(headers[0], no_wrap=True, style="bold")
    for r in rows:
        t.add_column(r[0], justify="right", no_wrap=True)
    for i, h in enumerate(headers[1:], start=1):
        t.add_row(h, *(r[i] for r in rows))
    return t


#: The bench table's columns: (header, figure from a run's summary JSON and the first run's
#: tokens/s). Times in ms.
_Col = tuple[str, Callable[[dict[str, Any], float | None], str]]
_COLUMNS: tuple[_Col, ...] = (
    ("ok", lambda s, b: str(s["requests_ok"])),
    ("fail", lambda s, b: str(s["requests_failed"])),
    ("TTFT p50", lambda s, b: _f(s["ttft_ms"]["p50"])),
    ("TTFT p99", lambda s, b: _f(s["ttft_ms"]["p99"])),
    ("ITL/tok p50", lambda s, b: _f(s["itl_token_ms"]["p50"], 2)),
    ("ITL/tok p99", lambda s, b: _f(s["itl_token_ms"]["p99"], 2)),
    ("ITL/chunk p50", lambda s, b: _f(s["itl_chunk_ms"]["p50"], 2)),
    ("TPOT p50", lambda s, b: _f(s["tpot_ms"]["p50"], 2)),
    ("e2e p50", lambda s, b: _f(s["e2e_ms"]["p50"])),
    ("e2e p99", lambda s, b: _f(s["e2e_ms"]["p99"])),
    ("tok/chunk", lambda s, b: _f(s["tokens_per_chunk"], 2)),
    ("tok/s", lambda s, b: _f(s["output_tokens_per_s"])),
)


def bench_table(
    console: Console,
    runs: Sequence[RunResult],
    slo: SLO | None,
    title: str = "tokenpipe bench",
    *,
    wide: bool = False,
) -> None:
    headers = ["run", "proto", "conc", *(c for c, _ in _COLUMNS)]
    if len(runs) > 1:
        headers.append("tok/s ratio")
    headers += ["req/s", "goodput/s"]
    rows = []
    base = None
    for i, run in enumerate(runs):
        s = run.summary(slo).to_json()
        tps = s["output_tokens_per_s"]
        base = base or tps
        row = [
            run.label or (f"run {i + 1}" if len(runs) > 1 else "run"),
            ",".join(run.protocols),
            str(run.concurrency),
            *(fn(s, base) for _, fn in _COLUMNS),
        ]
        if len(runs) > 1:
            row.append(f"{tps / base:.2f}x" if base and tps else "-")
        row += [_f(s["requests_per_s"], 2), _f(s["goodput"], 2) if slo else NO_SLO]
        rows.append(row)
    caption = (
        "times in ms; ITL/tok: chunk gap / tokens in the chunk (tokens from usage)"
        + ("; tok/s ratio against the first run" if len(runs) > 1 else "")
        + (f"; SLO {slo.to_json()}" if slo else "; goodput needs --slo")
    )
    fit(console, title, headers, rows, caption=caption, wide=wide, left=frozenset({0, 1}))


def temperature_table(console: Console, runs: Sequence[RunResult], *, wide: bool = False) -> None:
    """Median tokens/s per temperature (a temperature listed twice is sampled twice, which
    interleaves the runs against drift), with the ratio against the first temperature."""
    import statistics

    by_t: dict[float | None, list[dict[str, Any]]] = {}
    for run in runs:
        by_t.setdefault(run.temperature, []).append(run.summary().to_json())
    rows = []
    base = None
    for temp, sums in by_t.items():
        tps = statistics.median(s["output_tokens_per_s"] or 0.0 for s in sums)
        tpot = statistics.median(s["tpot_ms"]["p50"] or 0.0 for s in sums)
        ttft = statistics.median(s["ttft_ms"]["p50"] or 0.0 for s in sums)
        base = base or tps or None
        rows.append(
            [
                str(temp),
                str(len(sums)),
                f"{tps:,.1f}",
                f"{tpot:.2f}",
                f"{ttft:.1f}",
                f"{tps / base:.2f}x" if base else "-",
            ]
        )
    headers = ("temperature", "runs", "tokens/s", "TPOT p50 ms", "TTFT p50 ms", "ratio")
    fit(console, "tokens/s per temperature (median of runs)", headers, rows, wide=wide)


def ceiling_table(
    console: Console,
    title: str,
    results: Sequence[tuple[int, RunResult, Any]],
    processes: int,
    *,
    wide: bool = False,
) -> None:
    """The `--self-test` table: one row per concurrency, `Ceiling` figures."""
    rows = []
    for c, run, ce in results:
        s = run.summary()
        rows.append(
            [
                str(c),
                str(s.requests_ok),
                str(s.requests_failed),
                f"{ce.tokens_per_s:,.0f}",
                f"{ce.chunks_per_s:,.0f}",
                f"{ce.requests_per_s:,.1f}",
                f"{ce.client_cpu:.2f}",
                f"{ce.sim_cpu:.2f}",
                ce.verdict(processes),
            ]
        )
    headers = (
        "concurrency",
        "ok",
        "failed",
        "tokens/s",
        "chunks/s",
        "requests/s",
        "client CPU (cores)",
        "sim CPU (cores)",
        "verdict",
    )
    fit(console, title, headers, rows, wide=wide)
