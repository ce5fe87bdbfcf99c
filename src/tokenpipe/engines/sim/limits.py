"""The sim's RPM/TPM rate limits: token buckets, OpenAI's x-ratelimit-* or Anthropic's
anthropic-ratelimit-* headers, Retry-After."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime

from tokenpipe.control.bucket import TokenBucket
from tokenpipe.control.ratelimit_headers import go_duration


class RateLimits:
    """A requests-per-minute and a tokens-per-minute bucket; either may be off (None or 0)."""

    def __init__(self, rpm: float | None, tpm: float | None, bucket_seconds: float) -> None:
        self.rpm_limit = rpm
        self.tpm_limit = tpm
        self.rpm = _bucket(rpm, bucket_seconds)
        self.tpm = _bucket(tpm, bucket_seconds)

    def admit(self, cost_tokens: int, anthropic: bool = False) -> tuple[float, dict[str, str]]:
        """Charges the RPM/TPM buckets. Returns (seconds to wait or 0, rate-limit headers:
        OpenAI's x-ratelimit-*, or with `anthropic` Anthropic's anthropic-ratelimit-*)."""
        headers: dict[str, str] = {}
        charges = [(b, n) for b, n in ((self.rpm, 1), (self.tpm, cost_tokens)) if b is not None]
        wait = max((_peek(b, n) for b, n in charges), default=0.0)
        if wait == 0.0:
            for b, n in charges:
                b.take(n)
        for bucket, limit, kind in (
            (self.rpm, self.rpm_limit, "requests"),
            (self.tpm, self.tpm_limit, "tokens"),
        ):
            if bucket is None or limit is None:
                continue
            if anthropic:  # resets as RFC 3339 instants
                name = f"anthropic-ratelimit-{kind}"
                headers[f"{name}-limit"] = str(int(limit))
                headers[f"{name}-remaining"] = str(int(bucket.level))
                headers[f"{name}-reset"] = rfc3339(time.time() + bucket.seconds_until_full())
                continue
            headers[f"x-ratelimit-limit-{kind}"] = str(int(limit))
            headers[f"x-ratelimit-remaining-{kind}"] = str(int(bucket.level))
            headers[f"x-ratelimit-reset-{kind}"] = go_duration(bucket.seconds_until_full())
        return wait, headers


def rfc3339(wall: float) -> str:
    """A wall-clock time as Anthropic writes its resets: `2026-01-02T03:04:05.678Z`."""
    when = datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds")
    return when.replace("+00:00", "Z")


def retry_headers(wait: float, headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus Retry-After (seconds) and retry-after-ms; an endless wait says 60 s."""
    wait = 60.0 if math.isinf(wait) else wait
    return {
        **headers,
        "retry-after": str(max(1, math.ceil(wait))),
        "retry-after-ms": str(max(1, math.ceil(wait * 1000))),
    }


def _bucket(per_minute: float | None, bucket_seconds: float) -> TokenBucket | None:
    if not per_minute:
        return None
    rate = per_minute / 60.0
    return TokenBucket(rate, rate * bucket_seconds)


def _peek(bucket: TokenBucket, n: float) -> float:
    """Seconds until n units are in the bucket, without taking them."""
    level = bucket.level
    if n <= level:
        return 0.0
    if n > bucket.capacity:
        return math.inf
    return (n - level) / bucket.rate
