"""Token bucket with continuous refill. Clock-injected; shared by the sim and the limiter."""

from __future__ import annotations

from tokenpipe.clock import MONOTONIC, Clock


class TokenBucket:
    """`rate` units per second flow into a bucket that holds at most `capacity` units.

    `take(n)` either takes n units and returns 0.0, or takes nothing and returns how many
    seconds until n units will be there (inf if n exceeds the capacity).
    """

    __slots__ = ("_level", "_updated", "capacity", "clock", "rate")

    def __init__(self, rate: float, capacity: float, clock: Clock = MONOTONIC,
                 level: float | None = None) -> None:
        self.rate = rate
        self.capacity = capacity
        self.clock = clock
        self._level = capacity if level is None else level
        self._updated = clock.now()

    def _refill(self) -> float:
        now = self.clock.now()
        self._level = min(self.capacity, self._level + (now - self._updated) * self.rate)
        self._updated = now
        return self._level

    @property
    def level(self) -> float:
        return self._refill()

    def take(self, n: float = 1.0) -> float:
        level = self._refill()
        if n <= level:
            self._level = level - n
            return 0.0
        if n > self.capacity or self.rate <= 0:
            return float("inf")
        return (n - level) / self.rate

    def seconds_until_full(self) -> float:
        level = self._refill()
        return 0.0 if self.rate <= 0 else (self.capacity - level) / self.rate
