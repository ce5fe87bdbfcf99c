"""Budgets that keep retries and hedges a bounded share of traffic, and the backoff between
retries.

A `RatioBudget` counts requests and spends over a sliding window (a ring of time slices):
a spend is allowed while spends < ratio x requests + reserve. The reserve lets a quiet
gateway still retry; the ratio stops retries from multiplying the load during an outage
(Finagle's RetryBudget, the same idea).
"""

from __future__ import annotations

import random

from tokenpipe.clock import MONOTONIC, Clock


class RatioBudget:
    __slots__ = ("_clock", "_ring", "_slices", "_width", "ratio", "reserve")

    def __init__(
        self,
        ratio: float,
        reserve: float = 0.0,
        window: float = 10.0,
        slices: int = 10,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.ratio = ratio  # spends allowed per request
        self.reserve = reserve  # spends allowed per window on top of the ratio
        self._clock = clock
        self._width = window / slices  # seconds per slice
        self._slices = slices
        # slice number -> [requests, spends]; bounded: at most `slices` entries.
        self._ring: dict[int, list[float]] = {}

    def _slot(self) -> list[float]:
        n = int(self._clock.now() // self._width)
        slot = self._ring.get(n)
        if slot is None:
            oldest = n - self._slices + 1
            for k in [k for k in self._ring if k < oldest]:
                del self._ring[k]
            slot = self._ring[n] = [0.0, 0.0]
        return slot

    def _totals(self) -> tuple[float, float]:
        self._slot()  # expires old slices
        requests = sum(s[0] for s in self._ring.values())
        spends = sum(s[1] for s in self._ring.values())
        return requests, spends

    def request(self) -> None:
        """A request arrived (it earns `ratio` spends)."""
        self._slot()[0] += 1

    def available(self) -> float:
        requests, spends = self._totals()
        return self.ratio * requests + self.reserve - spends

    def try_spend(self) -> bool:
        """Spends one if the budget allows; False means: do not retry (or hedge)."""
        if self.available() < 1.0:
            return False
        self._slot()[1] += 1
        return True

    def share(self) -> float:
        """Spends per request in the window (for tests and metrics)."""
        requests, spends = self._totals()
        return spends / requests if requests else 0.0


def backoff(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Full-jitter exponential backoff (seconds) before retry number `attempt` (1, 2, ...):
    uniform in [0, min(cap, base x 2^(attempt-1))], so retries of many requests spread out."""
    top = min(cap, base * (2 ** max(0, attempt - 1)))
    return (rng or random).uniform(0.0, top)
