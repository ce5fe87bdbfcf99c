"""Deadlines that follow what an upstream actually does: clamp(k x quantile, floor, ceiling),
with a static value until the estimate has enough samples to be trusted."""

from __future__ import annotations

from dataclasses import dataclass

from tokenpipe.control.quantiles import RollingQuantiles
from tokenpipe.errors import GatewayError


@dataclass(frozen=True, slots=True)
class AdaptiveDeadline:
    k: float = 1.5  # multiple of the quantile
    quantile: float = 0.99
    floor: float = 2.0  # seconds
    ceiling: float = 10.0  # seconds
    initial: float = 10.0  # seconds, until `min_samples` values were seen
    min_samples: int = 20

    def value(self, est: RollingQuantiles | None) -> float:
        if est is None or est.count < self.min_samples:
            return self.initial
        q = est.quantile(self.quantile)
        if q is None:
            return self.initial
        return min(self.ceiling, max(self.floor, self.k * q))


#: Seconds before `End.at` that count as at it (timer resolution, see End.passed).
SLACK = 0.01
#: Client header asking for a shorter whole-request deadline (seconds).
DEADLINE_HEADER = "x-tokenpipe-deadline-seconds"


@dataclass(frozen=True, slots=True)
class End:
    """The whole-request deadline: when (`at`, on the tail clock), how long it was (`seconds`)
    and whose it is. `client`: the client's header set it (the gateway's `tail.total_seconds`
    was longer or unset). A request cut by the client's own deadline is not evidence
    against the upstream: no breaker failure, no concurrency drop, no latency sample."""

    at: float
    seconds: float
    client: bool

    def passed(self, now: float) -> bool:
        """Has it passed at `now`? Within SLACK: asyncio runs a timer up to its clock
        resolution early, so a timeout set for `at` may fire a hair before it."""
        return now >= self.at - SLACK

    def name(self) -> str:
        if self.client:
            return f"the client's deadline of {self.seconds:.3g} s ({DEADLINE_HEADER})"
        return f"the gateway's total deadline of {self.seconds:.3g} s (tail.total_seconds)"

    def error(self, before_first_token: bool) -> GatewayError:
        when = "before the first token" if before_first_token else "mid-stream"
        return GatewayError(
            504,
            f"{self.name()} passed {when}",
            code="upstream_timeout",  # the contract's code for every 504 (the text says whose)
        )
