"""How many tokens a stream may send now: credit (gRPC window-style grants) and a pace.

Pure and clock-injected. `credit` is None until the first grant (unlimited); each grant adds to
it (a first grant of 0 pauses the stream). The pace is a token bucket whose burst is a short
interval's worth of tokens, so a paced stream is sent in small, evenly spaced batches.
"""

from __future__ import annotations

import math

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control.bucket import TokenBucket

#: Burst of the pace bucket, in seconds of the rate (at least one token).
PACE_BURST_SECONDS = 0.05


class FlowGate:
    __slots__ = ("_pace", "clock", "credit")

    def __init__(self, clock: Clock = MONOTONIC) -> None:
        self.clock = clock
        self.credit: int | None = None
        self._pace: TokenBucket | None = None

    @property
    def rate(self) -> float | None:
        return self._pace.rate if self._pace is not None else None

    def grant(self, tokens: int) -> None:
        self.credit = (self.credit or 0) + tokens

    def set_rate(self, tokens_per_second: float | None) -> None:
        """None or 0 clears the pace."""
        if not tokens_per_second or tokens_per_second <= 0:
            self._pace = None
            return
        burst = max(1.0, tokens_per_second * PACE_BURST_SECONDS)
        # Start with one token, not a full burst: the first token goes out at once, the rest
        # at the rate.
        self._pace = TokenBucket(tokens_per_second, burst, self.clock, level=1.0)

    def allowance(self) -> tuple[int, float]:
        """(tokens that may be sent now, seconds until one more may be sent if 0 now).

        The wait is inf when only a grant can unblock the stream."""
        allowed = math.inf if self.credit is None else float(self.credit)
        wait = 0.0
        if self._pace is not None:
            level = self._pace.level
            allowed = min(allowed, math.floor(level + 1e-9))
            if allowed < 1 and self.credit != 0:
                wait = (1.0 - level) / self._pace.rate
        if self.credit == 0:
            wait = math.inf
        if allowed == math.inf:
            return (2**31, 0.0)
        return (int(allowed), wait if allowed < 1 else 0.0)

    def consume(self, tokens: int) -> None:
        if tokens <= 0:
            return
        if self.credit is not None:
            self.credit = max(0, self.credit - tokens)
        if self._pace is not None:
            self._pace.give(-tokens)  # may go below zero: the next tokens wait longer
