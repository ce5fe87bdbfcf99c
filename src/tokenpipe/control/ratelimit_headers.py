"""Reads an upstream's own statement of its rate limits from response headers.

OpenAI: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, resets as Go durations
(`6m0s`, `1s`, `12ms`, `1h2m3.5s`). Anthropic: `anthropic-ratelimit-{requests,tokens,
input-tokens,output-tokens}-{limit,remaining,reset}`, resets as RFC 3339 instants. Both:
`retry-after` (seconds or an HTTP date) and `retry-after-ms`. Pure functions; the wall clock
(for absolute resets) is passed in so tests fix it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from email.utils import parsedate_to_datetime

#: The period both providers' `limit` headers refer to (seconds): requests/tokens per minute.
WINDOW = 60.0

_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|us|µs|ns|m|s)")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_KINDS = ("requests", "tokens", "input-tokens", "output-tokens")


@dataclass(slots=True)
class Reading:
    """One bucket as the upstream reports it. Any part may be missing."""

    limit: float | None = None  # units per WINDOW
    remaining: float | None = None  # units
    reset: float | None = None  # seconds until the bucket is full again

    @property
    def rate(self) -> float | None:
        """Refill rate in units per second."""
        return None if self.limit is None else self.limit / WINDOW

    def capacity(self) -> float | None:
        """Depth of the bucket: what is left plus what refills before it is full.

        `remaining` is floored and `reset` rounded to a millisecond by providers, so the sum
        lands in (depth - 1, depth]; rounding up past a small slack recovers the depth.
        """
        rate = self.rate
        if rate is None or self.remaining is None or self.reset is None:
            return self.limit
        depth = self.remaining + self.reset * rate
        whole = float(int(depth - 0.01) + 1) if depth > 0.01 else 0.0
        return min(self.limit, whole) if self.limit is not None else whole


@dataclass(slots=True)
class RateLimits:
    readings: dict[str, Reading] = field(default_factory=dict)  # by kind: requests, tokens, ...
    retry_after: float | None = None  # seconds

    @property
    def requests(self) -> Reading | None:
        return self.readings.get("requests")

    @property
    def tokens(self) -> Reading | None:
        """Total tokens; Anthropic's input-token bucket stands in when there is no total."""
        return self.readings.get("tokens") or self.readings.get("input-tokens")

    def __bool__(self) -> bool:
        return bool(self.readings) or self.retry_after is not None


def parse_duration(text: str) -> float | None:
    """A Go duration (`6m0s`, `1.5s`, `12ms`) or a bare number of seconds, in seconds."""
    text = text.strip()
    if not text:
        return None
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    total = 0.0
    end = 0
    for m in _GO_DURATION.finditer(text):
        if m.start() != end:
            return None
        total += float(m.group(1)) * _UNIT[m.group(2)]
        end = m.end()
    return total if end == len(text) and end > 0 else None


def parse_instant(text: str, now_wall: float) -> float | None:
    """An RFC 3339 instant (`2024-05-01T12:00:05Z`) as seconds from now (>= 0)."""
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now_wall)


def parse_retry_after(value: str, now_wall: float) -> float | None:
    """`retry-after`: seconds (integer or decimal) or an HTTP date, as seconds from now."""
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - now_wall)
    except (TypeError, ValueError, IndexError):
        return None


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse(headers: Mapping[str, str], now_wall: float) -> RateLimits:
    """Everything the headers say about limits; unknown or malformed values are left out.

    One pass over the headers (this runs for every upstream answer): a response names each
    header once, and most name none of these."""
    openai: dict[str, dict[str, str]] = {}  # kind -> field (limit/remaining/reset) -> value
    anthropic: dict[str, dict[str, str]] = {}
    retry_after = retry_after_ms = None
    for name, value in headers.items():
        n = name.lower()
        if n.startswith("x-ratelimit-"):  # x-ratelimit-{field}-{kind}
            what, _, kind = n[12:].partition("-")
            openai.setdefault(kind, {})[what] = value
        elif n.startswith("anthropic-ratelimit-"):  # anthropic-ratelimit-{kind}-{field}
            kind, _, what = n[20:].rpartition("-")
            anthropic.setdefault(kind, {})[what] = value
        elif n == "retry-after":
            retry_after = value
        elif n == "retry-after-ms":
            retry_after_ms = value
    out = RateLimits()
    for kind in _KINDS if openai or anthropic else ():
        for fields, instant in ((openai.get(kind), False), (anthropic.get(kind), True)):
            if not fields:
                continue
            reading = Reading(_number(fields.get("limit")), _number(fields.get("remaining")))
            if reading.limit is None and reading.remaining is None:
                continue
            reset = fields.get("reset")
            if reset is not None:
                reading.reset = parse_instant(reset, now_wall) if instant else parse_duration(reset)
            out.readings[kind] = reading
            break  # OpenAI's headers win over Anthropic's for the same kind
    ms = _number(retry_after_ms)
    if ms is not None:
        out.retry_after = max(0.0, ms / 1000.0)
    elif retry_after is not None:
        out.retry_after = parse_retry_after(retry_after, now_wall)
    return out


def go_duration(seconds: float) -> str:
    """Formats like OpenAI's reset headers (Go durations): 12ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, secs = divmod(seconds, 60)
    s = f"{secs:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{s}s" if minutes else f"{s}s"
