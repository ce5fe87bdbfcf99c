"""Latency against output length: a least-squares line, R², and a check for super-linear growth.

Some write-ups claim generation time grows exponentially past ~50 output tokens. Decoding one
token costs roughly the same at every position for the context lengths of a chat answer, so the
expectation is a line (intercept: TTFT, slope: time per output token). The check compares the
slope over the longer half of the lengths with the slope over the shorter half: a line gives a
ratio near 1, growth that speeds up gives a ratio well above 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Upper-half slope / lower-half slope above which growth is called super-linear.
SUPERLINEAR_RATIO = 1.5


@dataclass(slots=True)
class LinearFit:
    slope: float
    intercept: float
    r2: float
    n: int

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
    n = len(xs)
    if n < 2 or n != len(ys):
        raise ValueError("need at least two (x, y) points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all x are equal: vary the output length")
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return LinearFit(slope, intercept, r2, n)


@dataclass(slots=True)
class ScalingCheck:
    fit: LinearFit
    slope_low: float | None
    slope_high: float | None
    superlinear: bool
    evidence: str


def check_scaling(xs: Sequence[float], ys: Sequence[float], unit: str = "ms") -> ScalingCheck:
    """Linear fit of y (latency) against x (output tokens) and the half-vs-half slope test."""
    fit = linear_fit(xs, ys)
    levels = sorted(set(xs))
    lo = hi = None
    # Two halves with two distinct lengths each need four lengths; with three, the middle one
    # sits in both halves and one noisy point decides the ratio.
    if len(levels) >= 4:
        mid = levels[len(levels) // 2]
        low = [(x, y) for x, y in zip(xs, ys, strict=True) if x <= mid]
        high = [(x, y) for x, y in zip(xs, ys, strict=True) if x >= mid]
        if len({x for x, _ in low}) >= 2 and len({x for x, _ in high}) >= 2:
            lo = linear_fit([x for x, _ in low], [y for _, y in low]).slope
            hi = linear_fit([x for x, _ in high], [y for _, y in high]).slope
    ratio = hi / lo if lo and hi is not None and lo > 0 else None
    superlinear = ratio is not None and ratio > SUPERLINEAR_RATIO
    text = (
        f"latency = {fit.intercept:.1f} {unit} + {fit.slope:.3f} {unit}/token x tokens, "
        f"R\u00b2 {fit.r2:.4f} over {fit.n} requests ({levels[0]:g}-{levels[-1]:g} tokens)"
    )
    if ratio is not None:
        text += (
            f"; slope {lo:.3f} {unit}/token on the shorter half vs {hi:.3f} on the longer "
            f"half (ratio {ratio:.2f}, super-linear above {SUPERLINEAR_RATIO})"
        )
    text += ": grows faster than linear" if superlinear else ": linear, no super-linear growth"
    return ScalingCheck(fit, lo, hi, superlinear, text)
