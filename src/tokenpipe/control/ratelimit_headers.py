"""Reads an upstream's own statement of its rate limits from response headers.

OpenAI: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, resets as Go durations
(`6m0s`, `1s`, `12ms`, `1h2m3.5s`). Anthropic: `anthropic-ratelimit-{requests,tokens,
input-tokens,output-tokens}-{limit,remaining,reset}`, resets as RFC 3339 instants. Both:
`retry-after` (seconds or an HTTP date) and `retry-after-ms`. Pure functions; the wall clock
(for absolute resets) is passed in so tests fix it.

Nothing is believed unbounded (see `bounds`): non-finite, negative and unparsable values are
left out, a limit below `MIN_LIMIT` is left out (0 would block the upstream forever), pauses
are capped at `MAX_PAUSE`, resets at `MAX_RESET`, counts at `MAX_COUNT`. `RateLimits.notes`
says what was dropped or clamped, for a rate-limited log line.

And the two ends of it: `learned_spec` turns a reading into a bucket, `rate_headers` writes
the same headers for the gateway's own 429s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from email.utils import parsedate_to_datetime

from tokenpipe.control.bounds import MAX_COUNT, MAX_PAUSE, MAX_RESET, MIN_LIMIT, show
from tokenpipe.control.store import Decision, Limits, Spec

#: The period both providers' `limit` headers refer to (seconds): requests/tokens per minute.
WINDOW = 60.0

_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|us|µs|ns|m|s)")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_KINDS = ("requests", "tokens", "input-tokens", "output-tokens")
#: The first letters of the headers `parse` reads (x-ratelimit-*, anthropic-ratelimit-*,
#: retry-after*), either case.
_FIRST = frozenset("xXaArR")


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
    retry_after: float | None = None  # seconds, at most MAX_PAUSE
    #: (kind, what was done) for each value dropped or clamped; kind is one of a fixed set
    #: ("retry-after", "limit", "remaining", "reset"), so a log limiter keyed by it is bounded.
    notes: list[tuple[str, str]] = field(default_factory=list)

    @property
    def requests(self) -> Reading | None:
        return self.readings.get("requests")

    @property
    def tokens(self) -> Reading | None:
        """Total tokens; Anthropic's input-token bucket stands in when there is no total."""
        return self.readings.get("tokens") or self.readings.get("input-tokens")

    def __bool__(self) -> bool:
        return bool(self.readings) or self.retry_after is not None


#: parse_duration's answers by text: providers send the same few resets ("6ms", "1s") on
#: answer after answer, and a regex pass costs ~1.3 us. Bound: _DURATIONS_MAX texts of at
#: most _DURATION_KEY_MAX characters (~100 KiB; then it starts again empty); a longer text
#: (an upstream's nonsense, up to the head's 64 KiB) is parsed and not kept.
_DURATIONS: dict[str, float | None] = {}
_DURATIONS_MAX = 1024
_DURATION_KEY_MAX = 32


def parse_duration(text: str) -> float | None:
    """A Go duration (`6m0s`, `1.5s`, `12ms`) or a bare number of seconds, in seconds."""
    if text in _DURATIONS:
        return _DURATIONS[text]
    if len(text) > _DURATION_KEY_MAX:
        return _parse_duration(text)
    if len(_DURATIONS) >= _DURATIONS_MAX:
        _DURATIONS.clear()
    seconds = _DURATIONS[text] = _parse_duration(text)
    return seconds


def _parse_duration(text: str) -> float | None:
    text = text.strip()
    if not text:
        return None
    try:
        bare = float(text)
    except ValueError:
        pass
    else:
        return bare if math.isfinite(bare) and bare >= 0 else None
    total = 0.0
    end = 0
    for m in _GO_DURATION.finditer(text):
        if m.start() != end:
            return None
        total += float(m.group(1)) * _UNIT[m.group(2)]
        end = m.end()
    ok = end == len(text) and end > 0 and math.isfinite(total)
    return total if ok else None


def parse_instant(text: str, now_wall: float) -> float | None:
    """An RFC 3339 instant (`2024-05-01T12:00:05Z`) as seconds from now (>= 0)."""
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        if when.tzinfo is None:
            return None
        return max(0.0, when.timestamp() - now_wall)
    except (ValueError, OverflowError):
        return None


def parse_retry_after(value: str, now_wall: float) -> float | None:
    """`retry-after`: seconds (integer or decimal) or an HTTP date, as seconds from now.
    Unbounded (the caller caps it); None for negative, non-finite or unparsable values."""
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - now_wall)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _number(text: str | None) -> float | None:
    """A finite number >= 0, else None."""
    if text is None:
        return None
    try:
        x = float(text)
    except ValueError:
        return None
    return x if math.isfinite(x) and x >= 0 else None


def _bounded(
    notes: list[tuple[str, str]],
    what: str,
    text: str | None,
    x: float | None,
    low: float,
    high: float,
) -> float | None:
    """x within [low, high]; None (noted) when unparsable or below low, clamped (noted) above."""
    if text is None:
        return None
    if x is None or x < low:
        notes.append((what, f"{what} {show(text)} ignored"))
        return None
    if x > high:
        notes.append((what, f"{what} {show(text)} clamped to {high:g}"))
        return high
    return x


def mentions_limits(headers: Mapping[str, str]) -> bool:
    """The head names a header `parse` reads. Most answers name none, and this asks it in C
    calls alone: 0.4 us for eight headers, where `parse` runs a test a header in Python and
    builds its empty answer, 1.5 us (timeit). (`in` between str: only bytes' `in` raises and
    clears an exception first, sse.py.)"""
    names = "\n".join(headers).lower()
    return "ratelimit-" in names or "retry-after" in names


def parse(headers: Mapping[str, str], now_wall: float) -> RateLimits:
    """Everything the headers say about limits; unknown or malformed values are left out.

    One pass over the headers (this runs for every upstream answer): a response names each
    header once, and most name none of these."""
    openai: dict[str, dict[str, str]] = {}  # kind -> field (limit/remaining/reset) -> value
    anthropic: dict[str, dict[str, str]] = {}
    retry_after = retry_after_ms = None
    for name, value in headers.items():
        if name[:1] not in _FIRST:  # most headers, at the cost of one slice
            continue
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
    # Only the kinds the headers name (OpenAI's win over Anthropic's for the same kind):
    for kind, fields in openai.items():
        if kind in _KINDS:
            _read(out, kind, fields, None)
    for kind, fields in anthropic.items():
        if kind in _KINDS and kind not in out.readings:
            _read(out, kind, fields, now_wall)
    if retry_after_ms is not None:
        ms = _number(retry_after_ms)
        secs = None if ms is None else ms / 1000.0
        out.retry_after = _bounded(out.notes, "retry-after", retry_after_ms, secs, 0.0, MAX_PAUSE)
    if out.retry_after is None and retry_after is not None:
        secs = parse_retry_after(retry_after, now_wall)
        out.retry_after = _bounded(out.notes, "retry-after", retry_after, secs, 0.0, MAX_PAUSE)
    return out


def _read(out: RateLimits, kind: str, fields: dict[str, str], now_wall: float | None) -> None:
    """One bucket's fields into `out.readings[kind]`, unless neither its limit nor what
    remains is readable. `now_wall`: resets are instants (Anthropic's), else durations."""
    notes = out.notes
    lim, rem = fields.get("limit"), fields.get("remaining")
    reading = Reading(
        _bounded(notes, "limit", lim, _number(lim), MIN_LIMIT, MAX_COUNT),
        _bounded(notes, "remaining", rem, _number(rem), 0.0, MAX_COUNT),
    )
    if reading.limit is None and reading.remaining is None:
        return
    reset = fields.get("reset")
    if reset is not None:
        secs = parse_duration(reset) if now_wall is None else parse_instant(reset, now_wall)
        reading.reset = _bounded(notes, "reset", reset, secs, 0.0, MAX_RESET)
    out.readings[kind] = reading


def go_duration(seconds: float) -> str:
    """Formats like OpenAI's reset headers (Go durations): 12ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, secs = divmod(seconds, 60)
    s = f"{secs:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{s}s" if minutes else f"{s}s"


def learned_spec(old: Spec | None, reading: Reading | None) -> Spec | None:
    """Headers correct the configured (or earlier learned) bucket."""
    if reading is None or reading.rate is None:
        return old
    rate = reading.rate
    depth = reading.capacity()
    if depth is None:
        depth = old.capacity if old is not None else rate * WINDOW
    if old is not None and math.isclose(old.rate, rate):
        # Same limit: the deepest estimate so far is the closest (estimates only undershoot).
        depth = max(depth, old.capacity)
    return Spec(rate, max(1.0, depth))


def rate_headers(limits: Limits, d: Decision | None) -> dict[str, str]:
    """OpenAI-style `x-ratelimit-*` headers describing `limits` as of decision `d`."""
    out: dict[str, str] = {}
    for kind, spec, level in (
        ("requests", limits.requests, d.remaining_requests if d else None),
        ("tokens", limits.tokens, d.remaining_tokens if d else None),
    ):
        if spec is None:
            continue
        left = spec.capacity if level is None else max(0.0, level)
        out[f"x-ratelimit-limit-{kind}"] = str(int(spec.rate * WINDOW))
        out[f"x-ratelimit-remaining-{kind}"] = str(int(left))
        reset = (spec.capacity - left) / spec.rate if spec.rate > 0 else 0.0
        out[f"x-ratelimit-reset-{kind}"] = go_duration(max(0.0, reset))
    return out
