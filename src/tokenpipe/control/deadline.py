"""Deadlines that follow what an upstream actually does: clamp(k x quantile, floor, ceiling),
with a static value until the estimate has enough samples to be trusted."""

from __future__ import annotations

from dataclasses import dataclass

from tokenpipe.control.quantiles import RollingQuantiles


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
