"""The stall deadline on each wait for an upstream read, with one timer per stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

#: One read in this many adds its gap to the stall estimate: the quantiles stay the same,
#: the per-read cost of the sketch falls by as much.
GAP_SAMPLE_EVERY = 4


class StallWatch:
    """Cancels the reader when a read overruns its deadline, and samples the gaps.

    `now` is the clock of deadlines; `deadline(since)` when a read that started at `since`
    times out; `gap(seconds)` takes a sampled gap between reads (the stall estimate).

    A timer per read (asyncio.timeout rescheduled twice per read) costs two timer-heap
    operations per token; here a read only stamps its start (`start`), and the timer, when
    it fires, checks the read in progress and sets itself again for that read's deadline. A
    read that overruns cancels the reader, which `timed_out()` recognises.
    """

    __slots__ = (
        "_base",
        "_handle",
        "deadline",
        "expired",
        "gap",
        "now",
        "reading",
        "reads",
        "since",
        "task",
    )

    def __init__(
        self,
        now: Callable[[], float],
        deadline: Callable[[float], float],
        gap: Callable[[float], None],
        task: asyncio.Task[Any] | None = None,
    ) -> None:
        """`task`: the reader's, when the caller has it (else looked up: in CPython 3.11
        `asyncio.current_task()` costs a getpid system call)."""
        self.now = now
        self.deadline = deadline
        self.gap = gap
        if task is None:
            task = asyncio.current_task()
            assert task is not None
        self.task = task
        self._base = task.cancelling()
        self._handle: asyncio.TimerHandle | None = None
        self.since = 0.0  # clock time the read in progress started
        self.reading = False  # the reader is waiting for the upstream
        self.reads = 0
        self.expired = False

    def start(self, now: float) -> None:
        """The reader starts waiting for the upstream."""
        self.since = now
        self.reading = True
        if self._handle is None:  # the first read, or the timer fired between reads
            self._arm()

    def arrived(self, _pieces: object = None) -> None:
        """Bytes arrived: one gap in GAP_SAMPLE_EVERY goes to the estimate, and the deadline
        runs from here (bytes pushed while the reader still waits count as a read too). Takes
        the pushed pieces, unused, so that it is the push path's `after` itself."""
        now = self.now()
        self.reads += 1
        if self.reads % GAP_SAMPLE_EVERY == 1:
            self.gap(now - self.since)
        self.since = now

    def _arm(self) -> None:
        delay = self.deadline(self.since) - self.now()
        # At least 1 ms: loop timers have millisecond resolution.
        self._handle = asyncio.get_running_loop().call_later(max(0.001, delay), self._fire)

    def _fire(self) -> None:
        self._handle = None
        if not self.reading:
            return  # between reads (writing, backpressure): the next read sets it again
        if self.now() >= self.deadline(self.since):
            self.expired = True
            self.task.cancel()
        else:
            self._arm()

    def timed_out(self) -> bool:
        """After a CancelledError in the reader: was it this watch's (not a real cancel)?"""
        return self.expired and self.task.uncancel() <= self._base

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
