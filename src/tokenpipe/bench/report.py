"""The bench's outputs: the `--json` document and the terminal report (tables: `table`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console

from tokenpipe.bench.load import RunResult
from tokenpipe.bench.metrics import SLO, Summary
from tokenpipe.bench.table import bench_table


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


def print_report(
    runs: Sequence[RunResult],
    slo: SLO | None,
    console: Console | None = None,
    title: str = "tokenpipe bench",
    *,
    wide: bool = False,
) -> None:
    console = console or Console()
    bench_table(console, runs, slo, title, wide=wide)
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
