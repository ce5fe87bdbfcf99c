"""Deadlines that follow what an upstream actually does: clamp(k x quantile, floor, ceiling),
with a static value until the estimate has enough samples to be trusted."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control.quantiles import RollingQuantiles
from tokenpipe.errors import GatewayError


# eq=False: hashed by identity (C speed), as the key of its value in an estimate's memo.
@dataclass(frozen=True, slots=True, eq=False)
class AdaptiveDeadline:
    k: float = 1.5  # multiple of the quantile
    quantile: float = 0.99
    floor: float = 2.0  # seconds
    ceiling: float = 10.0  # seconds
    initial: float = 10.0  # seconds, until `min_samples` values were seen
    min_samples: int = 20

    def value(self, est: RollingQuantiles | None) -> float:
        if est is None:
            return self.initial
        return est.derived(self, self.of)  # once per refresh of the estimate's view

    def of(self, est: RollingQuantiles) -> float:
        """The deadline drawn from `est` now (`value` keeps it in the estimate's memo)."""
        if est.count < self.min_samples:
            return self.initial
        q = est.quantile(self.quantile)
        if q is None:
            return self.initial
        return min(self.ceiling, max(self.floor, self.k * q))


#: Seconds before `Scope.at` that count as at it (timer resolution, see Scope.passed).
SLACK = 0.01
#: Client header asking for a shorter whole-request deadline (seconds).
DEADLINE_HEADER = "x-tokenpipe-deadline-seconds"


@dataclass(frozen=True, slots=True)
class Scope:
    """One request's deadline scope: every wait of the request lies inside it (admission,
    context and its summary calls, the limiter queue, each attempt, each read).

    `at`: when it ends, on `clock` (math.inf: no bound); `seconds`: how long it was; `client`:
    the client's header set it (the gateway's `tail.total_seconds` was longer or unset). A
    request cut by the client's own deadline is not evidence against the upstream: no
    breaker failure, no concurrency drop, no latency sample."""

    at: float
    seconds: float
    client: bool
    clock: Clock

    @classmethod
    def open(
        cls, total: float | None, headers: Mapping[str, str] | None, clock: Clock = MONOTONIC
    ) -> Scope:
        """The scope of a request arriving now: the gateway's `total` or the client's header,
        whichever is shorter (a header value <= 0 or non-finite is ignored; not a number: 400)."""
        client = False
        raw = headers.get(DEADLINE_HEADER) if headers is not None else None
        if raw is not None:
            try:
                asked = float(raw)
            except ValueError:
                raise GatewayError(
                    400,
                    f"{DEADLINE_HEADER} must be a number of seconds.",
                    param=DEADLINE_HEADER,
                    code="invalid_request",
                ) from None
            if asked > 0 and math.isfinite(asked) and (total is None or asked < total):
                total, client = asked, True
        if total is None:
            return cls(math.inf, math.inf, False, clock)
        return cls(clock.now() + total, total, client, clock)

    @property
    def bounded(self) -> bool:
        return self.at != math.inf

    def left(self) -> float:
        """Seconds left (never below 0; math.inf without a bound)."""
        return max(0.0, self.at - self.clock.now()) if self.at != math.inf else math.inf

    def cap(self, seconds: float | None) -> float | None:
        """`seconds` (None: no bound of its own) capped at what is left of the scope."""
        if self.at == math.inf:  # (not `bounded`: per request, a call saved)
            return seconds
        left = max(0.0, self.at - self.clock.now())
        return left if seconds is None or seconds > left else seconds

    def passed(self, now: float | None = None) -> bool:
        """Has it passed (at `now`, default the clock's)? Within SLACK: asyncio runs a timer
        up to its clock resolution early, so a timeout set for `at` may fire a hair before."""
        return (self.clock.now() if now is None else now) >= self.at - SLACK

    def client_passed(self) -> bool:
        """The client's own deadline has passed (the upstream is not to blame)."""
        return self.client and self.passed()

    def name(self) -> str:
        if self.client:
            return f"the client's deadline of {self.seconds:.3g} s ({DEADLINE_HEADER})"
        return f"the gateway's total deadline of {self.seconds:.3g} s (tail.total_seconds)"

    def error(self, before_first_token: bool = True, where: str = "") -> GatewayError:
        when = "before the first token" if before_first_token else "mid-stream"
        if where:
            when = f"{when} ({where})"
        return GatewayError(
            504,
            f"{self.name()} passed {when}",
            code="upstream_timeout",  # the contract's code for every 504 (the text says whose)
        )


#: No deadline at all (internal calls made outside any request, tests).
UNBOUNDED = Scope(math.inf, math.inf, False, MONOTONIC)
