"""The runtime gauges the soak reads: event-loop lag, collector pauses, tasks, RSS, fds
(observe/runtime.py); the heap settled once the gateway listens (serving.settle_heap) and the
listening line written whole (serving.announce)."""

from __future__ import annotations

import asyncio
import gc
import io
import re
import sys
import time
import urllib.request
from typing import Any

from tests import procs
from tokenpipe import serving
from tokenpipe.observe import runtime
from tokenpipe.observe.metrics import REGISTRY


def _value(name: str) -> float:
    v = REGISTRY.get_sample_value(name)
    assert v is not None, name
    return v


async def _until(cond: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)  # polling a condition with a deadline


async def test_a_blocked_loop_shows_as_lag_and_tasks_rss_fds_are_sampled() -> None:
    sampler = runtime.RuntimeSampler(interval=0.02)
    sampler.start()
    try:
        assert _value("tokenpipe_resident_memory_bytes") > 0  # read when scraped
        await _until(lambda: sampler.samples > 0)  # the sampler's timer is running
        assert _value("tokenpipe_open_fds") > 0
        assert _value("tokenpipe_asyncio_tasks") >= 2  # this test and the sampler
        _value("tokenpipe_event_loop_lag_max_seconds")  # read: resets the max
        busy_until = time.monotonic() + 0.3
        while time.monotonic() < busy_until:  # the workload: a CPU-bound handler holds the loop
            pass
        await _until(lambda: _value("tokenpipe_event_loop_lag_seconds") >= 0.2)
        assert _value("tokenpipe_event_loop_lag_max_seconds") >= 0.2
        assert _value("tokenpipe_event_loop_lag_max_seconds") < 0.2  # reset by the read
    finally:
        await sampler.stop()


async def test_collector_pauses_are_timed_by_generation_while_the_sampler_runs() -> None:
    def count(generation: str) -> float:
        v = REGISTRY.get_sample_value(
            "tokenpipe_gc_pause_seconds_count", {"generation": generation}
        )
        return v or 0.0

    sampler = runtime.RuntimeSampler(interval=0.02)
    sampler.start()
    try:
        before = count("2"), count("1")
        gc.collect(2)
        gc.collect(1)
        assert count("2") == before[0] + 1
        assert count("1") == before[1] + 1
    finally:
        await sampler.stop()
    stopped = count("2")
    gc.collect(2)
    assert count("2") == stopped  # the hook left with the sampler


def test_settle_heap_freezes_the_start_up_heap_and_raises_the_young_threshold() -> None:
    threshold = gc.get_threshold()
    try:
        serving.settle_heap()
        assert gc.get_freeze_count() > 1000  # this process's modules, at least
        assert gc.get_threshold()[0] == serving.GC_GEN0_THRESHOLD
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_a_served_gateway_has_settled_its_heap(gateway: procs.Service) -> None:
    """The gateway process called settle_heap once listening: its frozen objects are on
    /metrics (and the collector's pauses are timed there)."""
    text = urllib.request.urlopen(gateway.url + "/metrics", timeout=10).read().decode()
    frozen = re.search(r"^tokenpipe_gc_frozen_objects (\S+)$", text, re.M)
    assert frozen is not None and float(frozen.group(1)) > 10_000
    assert "# TYPE tokenpipe_gc_pause_seconds histogram" in text


def test_announce_is_one_write_so_workers_lines_never_interleave(monkeypatch: Any) -> None:
    """`serve --workers N` processes share stdout, unbuffered in tests: a line must leave in
    one write (print() writes the text and the newline apart)."""
    writes: list[bytes] = []

    class Raw(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            writes.append(bytes(b))
            return len(b)

    out = io.TextIOWrapper(Raw(), write_through=True)  # what PYTHONUNBUFFERED gives
    monkeypatch.setattr(sys, "stdout", out)
    serving.announce("tokenpipe gateway listening on http://127.0.0.1:8000")
    assert writes == [b"tokenpipe gateway listening on http://127.0.0.1:8000\n"]
