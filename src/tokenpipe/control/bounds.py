"""Sane ranges for everything learned from an upstream's rate-limit headers or read back
from a shared store, and a rate-limited log line saying what was clamped.

An upstream (or another replica writing to Redis) can say anything: `retry-after: 999999`,
`x-ratelimit-remaining-tokens: -1e18`, a limit of `inf` or `0`. Believed, each wedges an
upstream for days or raises. Every such value passes through these bounds first.
"""

from __future__ import annotations

import logging
import math

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.log_budget import LogBudget

#: Longest pause an upstream's `retry-after` may impose (seconds). The official OpenAI and
#: Anthropic SDKs cap the Retry-After they honour at 60 s for the same reason.
MAX_PAUSE = 60.0
#: Longest bucket reset believed (seconds): per-minute buckets reset within 60 s, daily
#: ones within a day. A reset only feeds the depth estimate, which the limit caps anyway.
MAX_RESET = 86_400.0
#: Largest limit or remaining count believed (units per minute / units): ten thousand times
#: the biggest published tier (OpenAI's 150 M TPM); above it floats stop being exact enough.
MAX_COUNT = 1e12
#: Smallest limit believed (units per minute). 0 (or 1e-9) would block the upstream forever.
MIN_LIMIT = 1.0
#: Seconds between two log lines about the same (upstream, kind) of clamped value.
LOG_EVERY = 60.0
#: Bound on remembered (upstream, kind) pairs for the log limiter: cleared past it (which
#: at worst lets one extra line per pair through).
MAX_LOG_KEYS = 1024


def finite(x: float | None) -> float | None:
    """x when it is a finite number, else None."""
    return x if x is not None and math.isfinite(x) else None


def clamp(x: float, low: float, high: float) -> float:
    return low if x < low else high if x > high else x


def show(value: str, limit: int = 40) -> str:
    """A header value for a log line: quoted and truncated (a hostile one can be long)."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


class ClampLog:
    """One log line per (upstream, kind) per LOG_EVERY seconds; the rest are counted and the
    count is reported with the next line."""

    def __init__(self, logger: logging.Logger, clock: Clock = MONOTONIC) -> None:
        self._budget = LogBudget(logger, LOG_EVERY, max_keys=MAX_LOG_KEYS, clock=clock)

    def report(self, upstream: str, notes: list[tuple[str, str]]) -> None:
        """`notes`: (kind, what was done) pairs from `ratelimit_headers.parse`."""
        for kind, text in notes:
            self._budget.warning(
                (upstream, kind),
                "upstream %s sent a rate-limit header out of range: %s",
                upstream,
                text,
            )
