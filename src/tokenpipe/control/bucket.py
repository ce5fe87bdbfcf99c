"""Token bucket with continuous refill. Clock-injected; shared by the sim and the limiter."""

from __future__ import annotations

from tokenpipe.clock import MONOTONIC, Clock

#: Debt a bucket may carry, in bucket depths (a reservation larger than the bucket, or a
#: correction charging more, stops there).
MAX_DEBT = 2.0


class TokenBucket:
    """`rate` units per second flow into a bucket that holds at most `capacity` units.

    `take(n)` either takes n units and returns 0.0, or takes nothing and returns how many
    seconds until n units will be there (inf if n exceeds the capacity).

    The limiter also uses it as a GCRA-style reservation: `reserve(n)` admits a request as
    soon as min(n, capacity) units are there and takes all n, so the level may go negative
    (debt) and a request larger than the bucket still runs once, paid for by the wait of
    the next ones. `give(n)` corrects a reservation afterwards (n < 0 charges more).

    Bound: the level never goes below `-MAX_DEBT x capacity`, so after any reservation,
    correction or learned level the wait is at most (MAX_DEBT + 1) x capacity / rate: one
    huge (or hostile) request cannot lock the bucket for days.
    """

    __slots__ = ("_floor", "_level", "_updated", "capacity", "clock", "rate")

    def __init__(
        self, rate: float, capacity: float, clock: Clock = MONOTONIC, level: float | None = None
    ) -> None:
        self.rate = rate
        self.capacity = capacity
        self._floor = -MAX_DEBT * capacity  # the lowest level (see MAX_DEBT)
        self.clock = clock
        self._level = capacity if level is None else level
        self._updated = clock.now()

    # (No min() or max() of two numbers below, but the same tests in their order (min(a, b)
    # is `b if b < a else a`): each call is ~700 machine instructions, and these run several
    # times a request once an upstream's limits are known.)

    def _refill(self) -> float:
        now = self.clock.now()
        level = self._level
        if level < self.capacity:
            level += (now - self._updated) * self.rate
            self._level = level = level if level < self.capacity else self.capacity
        self._updated = now
        return level

    @property
    def level(self) -> float:
        return self._refill()

    @property
    def held(self) -> float:
        """The level as of the last refill (no clock read): after `wait_for` or `reserve`
        in the same step, the level now."""
        return self._level

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

    # -- reservations (limiter) ----------------------------------------------------------

    def wait_for(self, n: float) -> float:
        """Seconds until a reservation of n units would be admitted (0: now). Takes nothing."""
        need = self.capacity if self.capacity < n else n
        level = self._refill()
        if need <= level:
            return 0.0
        return float("inf") if self.rate <= 0 else (need - level) / self.rate

    def reserve(self, n: float) -> float:
        """Like take(), but admits at min(n, capacity) and may leave the level negative."""
        wait = self.wait_for(n)
        if wait == 0.0:
            self.commit(n)
        return wait

    def commit(self, n: float) -> None:
        """Takes a reservation of n units that `wait_for` admitted in this same step (no
        clock read: several buckets are checked first, then all are charged)."""
        level = self._level - n
        self._level = level if level > self._floor else self._floor

    def give(self, n: float) -> None:
        """Returns n units (a reservation that cost less than reserved); n < 0 charges more."""
        level = self._refill() + n
        level = level if level < self.capacity else self.capacity
        self._level = level if level > self._floor else self._floor

    def set_level(self, level: float) -> None:
        """What the upstream says is left (from its headers) replaces our own count, within
        [floor, capacity]. (Not refilled first: the level it would compute is replaced; an
        upstream's answer sets two levels a request, once its limits are known.)"""
        self._updated = self.clock.now()
        level = level if level < self.capacity else self.capacity
        self._level = level if level > self._floor else self._floor

    def configure(self, rate: float, capacity: float) -> None:
        """New refill rate and depth, learned or configured; the level is kept (clipped)."""
        self._refill()
        self.rate = rate
        self.capacity = capacity
        self._floor = -MAX_DEBT * capacity
        self._level = max(self._floor, min(self._level, capacity))
