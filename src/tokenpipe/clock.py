"""The one clock. Control logic takes a `Clock` so tests can drive time by hand."""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Any, Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic time in seconds."""
        ...


class MonotonicClock:
    __slots__ = ()

    # The C function itself (no Python frame): it is read per upstream read.
    now = staticmethod(time.monotonic)


class ManualClock:
    """A clock that moves only when told to (for tests of control algorithms)."""

    __slots__ = ("t",)

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


MONOTONIC = MonotonicClock()


class Timeout:
    """`asyncio.timeout(seconds)`'s contract for the request path, as a plain `with`: past
    `seconds` the task is cancelled and the block raises TimeoutError; a cancellation from
    outside stays a CancelledError. `expired()` tells this bound's TimeoutError from one
    raised below it. None: no bound (nothing armed).

    Why not asyncio.timeout: its state machine (enum states, two running-loop lookups, an
    async context manager) cost ~13 us a use in the gateway's profile, two uses per stream:
    5% of a 1-token request's CPU; this is one timer handle and one task lookup (~2.5 us)."""

    __slots__ = ("_cancelling", "_fired", "_handle", "_seconds", "_task")

    def __init__(self, seconds: float | None, task: asyncio.Task[Any] | None = None) -> None:
        """`task`: the one running the block, when the caller has it (else looked up at
        `__enter__`: in CPython 3.11 `asyncio.current_task()` costs a getpid system call)."""
        self._seconds = seconds
        self._task = task
        self._fired = False
        self._handle: asyncio.TimerHandle | None = None

    def __enter__(self) -> Timeout:
        if self._seconds is None:
            return self
        task = self._task
        if task is None:
            task = asyncio.current_task()
            if task is None:
                raise RuntimeError("Timeout must be used inside a task")
            self._task = task
        self._cancelling = task.cancelling()
        self._handle = task.get_loop().call_later(self._seconds, self._fire)
        return self

    def _fire(self) -> None:
        self._fired = True
        self._handle = None
        assert self._task is not None  # (armed only at __enter__, with the task known)
        self._task.cancel()

    def expired(self) -> bool:
        return self._fired

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._fired:
            assert self._task is not None
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
