"""The bench's outputs: the `--json` document and the terminal table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenpipe.bench.load import RunResult
from tokenpipe.bench.metrics import SLO, Summary


def run_json(run: RunResult, slo: SLO | None) -> dict[str, Any]:
    return {
        "label": run.label,
        "protocol": ",".join(run.protocols),
        "concurrency": run.concurrency,
        "rate": run.rate,
        "temperature": run.temperature,
        "notes": run.notes,
        "summary": run.summary(slo).to_json(),
    }


def overall(runs: Sequence[RunResult], slo: SLO | None) -> Summary:
    """All runs merged (sketches merge exactly); runs were one after another, so walls add."""
    total = Summary(slo=slo)
    wall = 0.0
    for run in runs:
        total.merge(run.summary(slo))
        wall += run.wall_s
    total.wall_s = wall
    return total


def bench_json(
    runs: Sequence[RunResult], slo: SLO | None = None, *, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`{"requests": [...every request...], "summary": {...}, "runs": [...] }`.

    `summary` is the one run's summary, or all runs merged for a sweep or `--compare`, where
    `runs` holds one entry per run (per protocol for `--compare`)."""
    origin = min((r.started_at for r in runs), default=0.0)
    doc: dict[str, Any] = {"meta": meta or {}}
    doc["requests"] = [rec.to_json(origin) for run in runs for rec in run.records]
    doc["summary"] = overall(runs, slo).to_json()
    doc["runs"] = [run_json(r, slo) for r in runs]
    return doc


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def table(runs: Sequence[RunResult], slo: SLO | None, title: str = "tokenpipe bench") -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for col in (
        "run",
        "proto",
        "conc",
        "ok",
        "fail",
        "TTFT p50",
        "TTFT p99",
        "ITL/tok p50",
        "ITL/tok p99",
        "ITL/chunk p50",
        "TPOT p50",
        "e2e p50",
        "e2e p99",
        "tok/chunk",
        "tok/s",
        "req/s",
        "goodput/s",
    ):
        t.add_column(col, justify="left" if col in ("run", "proto") else "right")
    base = None
    for run in runs:
        s = run.summary(slo).to_json()
        tps = s["output_tokens_per_s"]
        base = base or tps
        t.add_row(
            run.label or "-",
            ",".join(run.protocols),
            str(run.concurrency),
            str(s["requests_ok"]),
            str(s["requests_failed"]),
            _f(s["ttft_ms"]["p50"]),
            _f(s["ttft_ms"]["p99"]),
            _f(s["itl_token_ms"]["p50"], 2),
            _f(s["itl_token_ms"]["p99"], 2),
            _f(s["itl_chunk_ms"]["p50"], 2),
            _f(s["tpot_ms"]["p50"], 2),
            _f(s["e2e_ms"]["p50"]),
            _f(s["e2e_ms"]["p99"]),
            _f(s["tokens_per_chunk"], 2),
            _f(tps) + (f" ({tps / base:.2f}x)" if base and tps and len(runs) > 1 else ""),
            _f(s["requests_per_s"], 2),
            _f(s["goodput"], 2),
        )
    t.caption = (
        "times in ms; ITL/tok: chunk gap / tokens in the chunk (tokens from usage); "
        "tok/s ratio against the first run" + (f"; SLO {slo.to_json()}" if slo else "")
    )
    return t


def print_report(
    runs: Sequence[RunResult],
    slo: SLO | None,
    console: Console | None = None,
    title: str = "tokenpipe bench",
) -> None:
    console = console or Console()
    console.print(table(runs, slo, title))
    for run in runs:
        for note in run.notes:
            console.print(f"[yellow]note[/] {run.label + ': ' if run.label else ''}{note}")
        errors: dict[str, int] = {}
        for rec in run.records:
            if not rec.ok:
                key = (rec.error or f"status {rec.status}")[:120]
                errors[key] = errors.get(key, 0) + 1
        for msg, n in sorted(errors.items(), key=lambda kv: -kv[1])[:5]:
            console.print(f"[red]failed[/] {run.label + ': ' if run.label else ''}{n} x {msg}")
