"""A `tokenpipe bench` sweep: one run per (temperature, concurrency), in one process with a live
progress bar or over worker processes, each run's records split by protocol."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tokenpipe.bench.load import run_load, run_load_processes
from tokenpipe.serving import install_uvloop


class LiveFigures:
    """Live figures for the progress bar. Bound: the last 256 TTFTs."""

    def __init__(self) -> None:
        self.ttfts: deque[float] = deque(maxlen=256)
        self.tokens = 0
        self.failed = 0
        self.started = time.perf_counter()

    def on_record(self, rec: Any) -> None:
        if rec.ok:
            if rec.ttft is not None:
                self.ttfts.append(rec.ttft)
            self.tokens += rec.output_tokens
        else:
            self.failed += 1

    def text(self) -> str:
        t = sorted(self.ttfts)
        p50 = f"{t[len(t) // 2] * 1000:.1f} ms" if t else "-"
        rate = self.tokens / max(1e-9, time.perf_counter() - self.started)
        return f"TTFT p50 {p50}  {rate:,.0f} tok/s  failed {self.failed}"


def run_sweep(
    url: str,
    model: str,
    concurrencies: list[int],
    temps: list[float | None],
    processes: int,
    kwargs: dict[str, Any],
    console: Any,
    err: Any,
    no_progress: bool,
) -> list:
    """Every run of the sweep, in plan order (temperature-major), split by protocol."""
    plan = [(t, c) for t in temps for c in concurrencies]
    runs = []

    def label(t: float | None, c: int) -> str:
        parts = []
        if len(concurrencies) > 1:
            parts.append(f"c={c}")
        if t is not None:
            parts.append(f"T={t}")
        return " ".join(parts)

    if processes > 1:
        for t, c in plan:
            err.print(f"run {label(t, c) or '1'}: {processes} processes ...")
            runs.append(
                run_load_processes(
                    processes, url, model, concurrency=c, temperature=t, label=label(t, c), **kwargs
                )
            )
    else:
        install_uvloop()
        total = kwargs["requests"]
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[live]}"),
            console=err,
            refresh_per_second=4,
            disable=no_progress,
        )

        async def go() -> None:
            with progress:
                for t, c in plan:
                    live = LiveFigures()
                    task = progress.add_task(label(t, c) or "run", total=total, live="")

                    def on_record(rec: Any, live: LiveFigures = live, task: Any = task) -> None:
                        live.on_record(rec)
                        progress.update(task, advance=1, live=live.text())

                    runs.append(
                        await run_load(
                            url,
                            model,
                            concurrency=c,
                            temperature=t,
                            label=label(t, c),
                            on_record=on_record,
                            **kwargs,
                        )
                    )

        asyncio.run(go())
    out = []
    for run in runs:
        out.extend(run.split_by_protocol())
    return out
