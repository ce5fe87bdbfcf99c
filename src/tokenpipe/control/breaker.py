"""A circuit breaker per upstream: after `failures` failures in a row the upstream is taken
out for `cooldown` seconds, then one probe request is let through (half-open); its success
closes the circuit, its failure opens it for another cooldown."""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum

from tokenpipe.clock import MONOTONIC, Clock


class State(IntEnum):
    CLOSED = 0  # in service
    HALF_OPEN = 1  # one probe in flight
    OPEN = 2  # out for the cooldown


# The members as module names, read on every request: an enum's own attribute costs ~850
# machine instructions in CPython 3.11 (its metaclass's __getattr__ routes every lookup on
# the class through a Python-level hook), a module's global ~20.
CLOSED, HALF_OPEN, OPEN = State.CLOSED, State.HALF_OPEN, State.OPEN


class CircuitBreaker:
    __slots__ = (
        "_changed",
        "_clock",
        "_probe_at",
        "cooldown",
        "failures",
        "opened_at",
        "row",
        "state",
    )

    def __init__(
        self,
        failures: int = 5,
        cooldown: float = 10.0,
        clock: Clock = MONOTONIC,
        changed: Callable[[State], None] | None = None,
    ):
        """`changed(state)`: called at each change of state (a gauge set then, not looked at
        on every request)."""
        self.failures = failures  # consecutive failures that open the circuit
        self.cooldown = cooldown  # seconds out before a probe
        self._clock = clock
        self._changed = changed
        self.state = CLOSED
        self.row = 0  # consecutive failures so far
        self.opened_at = 0.0
        self._probe_at = 0.0

    def allow(self) -> bool:
        """May a request go to this upstream now? (Claims the probe when half-open.)"""
        if self.state is CLOSED:
            return True
        now = self._clock.now()
        if self.state is OPEN:
            if now - self.opened_at < self.cooldown:
                return False
            self._probe_at = now
            self._to(HALF_OPEN)
            return True
        # Half-open: one probe at a time; a probe that never reports back (cancelled) is
        # forgotten after a cooldown so the upstream cannot stay out forever.
        if now - self._probe_at >= self.cooldown:
            self._probe_at = now
            return True
        return False

    def success(self) -> None:
        self.row = 0
        if self.state is not CLOSED:
            self._to(CLOSED)

    def failure(self) -> None:
        self.row += 1
        if self.state is HALF_OPEN or self.row >= self.failures:
            self.opened_at = self._clock.now()
            self._to(OPEN)

    def _to(self, state: State) -> None:
        was, self.state = self.state, state
        if self._changed is not None and state is not was:
            self._changed(state)
