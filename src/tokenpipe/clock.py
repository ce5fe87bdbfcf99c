"""The one clock. Control logic takes a `Clock` so tests can drive time by hand."""

from __future__ import annotations

import time
from typing import Protocol


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
