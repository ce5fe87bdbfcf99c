"""Process health as metrics: event-loop lag, garbage-collector pauses, live asyncio tasks,
resident memory, open file descriptors. Leaks show up as slopes of these over a long run
(benchmarks/soak.py).

One sampler task per process, started and stopped with the HTTP app. Lag is how late a
`sleep(interval)` wakes up: the time the loop was busy with something else. A collector pause
stops the loop too, so every waiting stream's next event is that much later; the pauses are
timed by a `gc.callbacks` hook (two `perf_counter` calls and one histogram observation per
collection, ~2 us, against collections of 0.1-25 ms). Tasks, RSS and fds are read when
/metrics is scraped, not on a timer: the work is done only when someone looks (listing
/proc/self/fd costs ~0.3 us per open fd, 0.6 ms once a second with 1,000 streams open).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from typing import Any

from prometheus_client import Gauge, Histogram

from tokenpipe.observe.metrics import REGISTRY

#: Sampling period (seconds): a lag shorter than the work between two samples is not seen.
INTERVAL = 0.25

LOOP_LAG = Gauge(
    "tokenpipe_event_loop_lag_seconds",
    "How late the event loop ran a timer in the last sample (seconds).",
    registry=REGISTRY,
)
LOOP_LAG_MAX = Gauge(
    "tokenpipe_event_loop_lag_max_seconds",
    "Largest event-loop lag since the last scrape of /metrics read it (seconds).",
    registry=REGISTRY,
)
TASKS = Gauge("tokenpipe_asyncio_tasks", "Live asyncio tasks in this process.", registry=REGISTRY)
RSS = Gauge(
    "tokenpipe_resident_memory_bytes", "Resident set size of this process.", registry=REGISTRY
)
FDS = Gauge("tokenpipe_open_fds", "Open file descriptors of this process.", registry=REGISTRY)
GC_PAUSE = Histogram(
    "tokenpipe_gc_pause_seconds",
    "Pauses of Python's cyclic garbage collector, by generation (seconds).",
    ["generation"],  # bound: 0, 1, 2
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
    registry=REGISTRY,
)
GC_FROZEN = Gauge(
    "tokenpipe_gc_frozen_objects",
    "Objects moved out of the collector's reach at start-up (gc.freeze; serving.settle_heap).",
    registry=REGISTRY,
)
_GC_PAUSES = [GC_PAUSE.labels(generation=str(g)) for g in range(3)]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> float:
    try:
        with open("/proc/self/statm", "rb") as f:
            return float(int(f.read().split()[1]) * _PAGE)
    except OSError:  # not Linux: leave the gauge at 0
        return 0.0


def _fds() -> float:
    try:
        return float(len(os.listdir("/proc/self/fd")))
    except OSError:
        return 0.0


def _tasks() -> float:
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:  # scraped outside the event loop's thread: nothing to count
        return 0.0


class RuntimeSampler:
    def __init__(self, interval: float = INTERVAL) -> None:
        self.interval = interval
        self._task: asyncio.Task[None] | None = None
        self._max = 0.0
        self._gc_started = 0.0
        #: Lag samples taken so far.
        self.samples = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())
        # The max resets when read, so each scrape sees the worst lag since the one before.
        LOOP_LAG_MAX.set_function(self._take_max)
        TASKS.set_function(_tasks)
        RSS.set_function(_rss)
        FDS.set_function(_fds)
        GC_FROZEN.set_function(lambda: float(gc.get_freeze_count()))
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            _GC_PAUSES[info["generation"]].observe(time.perf_counter() - self._gc_started)

    def _take_max(self) -> float:
        worst, self._max = self._max, 0.0
        return worst

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            lag = max(0.0, loop.time() - due)
            self._max = max(self._max, lag)
            LOOP_LAG.set(lag)
            self.samples += 1

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):  # stopped twice
            gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
