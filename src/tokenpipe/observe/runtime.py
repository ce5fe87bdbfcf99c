"""Process health as metrics: event-loop lag, live asyncio tasks, resident memory, open file
descriptors. Leaks show up as slopes of these over a long run (benchmarks/soak.py).

One sampler task per process, started and stopped with the HTTP app. Lag is how late a
`sleep(interval)` wakes up: the time the loop was busy with something else.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from prometheus_client import Gauge

from tokenpipe.observe.metrics import REGISTRY

#: Sampling period (seconds): a lag shorter than the work between two samples is not seen.
INTERVAL = 0.25
#: Tasks, RSS and fds are read every this many lag samples (once a second).
PROCESS_EVERY = 4

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


class RuntimeSampler:
    def __init__(self, interval: float = INTERVAL) -> None:
        self.interval = interval
        self._task: asyncio.Task[None] | None = None
        self._max = 0.0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())
        # The max resets when read, so each scrape sees the worst lag since the one before.
        LOOP_LAG_MAX.set_function(self._take_max)

    def _take_max(self) -> float:
        worst, self._max = self._max, 0.0
        return worst

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        tick = 0
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            lag = max(0.0, loop.time() - due)
            self._max = max(self._max, lag)
            LOOP_LAG.set(lag)
            if tick % PROCESS_EVERY == 0:
                # Listing /proc/self/fd costs ~0.3 us per open fd: once a second, not per tick.
                TASKS.set(len(asyncio.all_tasks(loop)))
                RSS.set(_rss())
                FDS.set(_fds())
            tick += 1

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
