"""The runtime gauges the soak reads: event-loop lag, tasks, RSS, fds (observe/runtime.py)."""

from __future__ import annotations

import asyncio
import time

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
        await _until(lambda: _value("tokenpipe_resident_memory_bytes") > 0)
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
