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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from email.utils import parsedate_to_datetime

from multidict import CIMultiDict, CIMultiDictProxy

from tokenpipe.control.bounds import MAX_COUNT, MAX_PAUSE, MAX_RESET, MIN_LIMIT, show
from tokenpipe.control.store import Decision, Limits, Spec

#: The period both providers' `limit` headers refer to (seconds): requests/tokens per minute.
WINDOW = 60.0

_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|us|µs|ns|m|s)")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_KINDS = ("requests", "tokens", "input-tokens", "output-tokens")
#: Mappings whose lookups ignore the case of a name (the upstream's heads are one).
_CASE_BLIND = (CIMultiDict, CIMultiDictProxy)


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
        limit = self.limit
        if limit is None or self.remaining is None or self.reset is None:
            return limit
        depth = self.remaining + self.reset * (limit / WINDOW)
        whole = float(int(depth - 0.01) + 1) if depth > 0.01 else 0.0
        return whole if whole < limit else limit


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


#: The parsers' answers by text (`parse_duration`'s seconds, `parse_instant`'s instants):
#: providers send the same few texts on answer after answer (OpenAI's resets "6ms", "1s";
#: Anthropic's instants, to the second), and a parse costs 0.6-1.3 us. Bound: MEMO_MAX texts
#: of at most MEMO_KEY_MAX characters each (~100 KiB; then it starts again empty); a longer
#: text (an upstream's nonsense, up to the head's 64 KiB) is parsed and not kept.
_DURATIONS: dict[str, float | None] = {}
_INSTANTS: dict[str, float | None] = {}  # epoch seconds
MEMO_MAX = 1024
MEMO_KEY_MAX = 32


def _remember(
    memo: dict[str, float | None], text: str, parse: Callable[[str], float | None]
) -> float | None:
    """`parse(text)`, kept in `memo` within its bound (the caller looked it up first)."""
    if len(text) > MEMO_KEY_MAX:
        return parse(text)
    if len(memo) >= MEMO_MAX:
        memo.clear()
    value = memo[text] = parse(text)
    return value


def parse_duration(text: str) -> float | None:
    """A Go duration (`6m0s`, `1.5s`, `12ms`) or a bare number of seconds, in seconds."""
    if text in _DURATIONS:
        return _DURATIONS[text]
    return _remember(_DURATIONS, text, _parse_duration)


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
    when = _INSTANTS[text] if text in _INSTANTS else _remember(_INSTANTS, text, _epoch)
    if when is None:
        return None
    return when - now_wall if when > now_wall else 0.0  # (max(): ~700 instructions)


def _epoch(text: str) -> float | None:
    """An RFC 3339 instant in seconds since the epoch; None without a time zone."""
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        if when.tzinfo is None:
            return None
        return when.timestamp()
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


def _count(notes: list[tuple[str, str]], what: str, text: str | None, low: float) -> float | None:
    """A limit or a remaining count within [low, MAX_COUNT]: the usual value in one test,
    any other as `_bounded` judges it (noted)."""
    if text is None:
        return None
    try:
        x = float(text)
    except ValueError:
        return _bounded(notes, what, text, None, low, MAX_COUNT)
    if low <= x <= MAX_COUNT:  # (NaN, infinities and negatives fail it)
        return x
    return _bounded(notes, what, text, x if math.isfinite(x) and x >= 0 else None, low, MAX_COUNT)


#: The headers `parse` reads for each kind of bucket: (kind, limit, remaining, reset).
_OPENAI = tuple(
    (k, f"x-ratelimit-limit-{k}", f"x-ratelimit-remaining-{k}", f"x-ratelimit-reset-{k}")
    for k in _KINDS
)
_ANTHROPIC = tuple(
    (
        k,
        f"anthropic-ratelimit-{k}-limit",
        f"anthropic-ratelimit-{k}-remaining",
        f"anthropic-ratelimit-{k}-reset",
    )
    for k in _KINDS
)


def limit_names(headers: Mapping[str, str]) -> str | None:
    """The head's names, lowercased and joined by newlines, when it names a header `parse`
    reads; else None. Most answers name none, and this asks it in C calls alone: 0.4 us for
    eight headers (timeit). (`in` between str: only bytes' `in` raises and clears an
    exception first, sse.py.)"""
    names = "\n".join(headers).lower()
    if "ratelimit-" in names or "retry-after" in names:
        return names
    return None


def parse(headers: Mapping[str, str], now_wall: float, names: str | None = None) -> RateLimits:
    """Everything the headers say about limits; unknown or malformed values are left out.
    `names`: `limit_names(headers)`, when the caller has it.

    This runs for every answer of an upstream that states its limits (OpenAI and Anthropic
    do). Each header it reads is looked up by name, in the families the head's names
    mention: 3.2 us for OpenAI's six among 16 headers, 5.4 for Anthropic's twelve among 22,
    where a pass over every header in Python, sorting them by name, took 6.8 and 15.5 us
    (timeit). A name sent twice is read once (its first value)."""
    if not isinstance(headers, _CASE_BLIND):
        headers = CIMultiDict(headers)  # a plain mapping: its names in any case too
    if names is None:
        names = "\n".join(headers).lower()
    out = RateLimits()
    get = headers.get
    # Only the kinds the headers name (OpenAI's win over Anthropic's for the same kind):
    if "x-ratelimit-" in names:
        for kind, limit, remaining, reset in _OPENAI:
            lim, rem = get(limit), get(remaining)
            if lim is not None or rem is not None:
                _read(out, kind, lim, rem, get(reset), None)
    if "anthropic-ratelimit-" in names:
        for kind, limit, remaining, reset in _ANTHROPIC:
            lim, rem = get(limit), get(remaining)
            if (lim is not None or rem is not None) and kind not in out.readings:
                _read(out, kind, lim, rem, get(reset), now_wall)
    if "retry-after" in names:
        retry_after_ms = get("retry-after-ms")
        if retry_after_ms is not None:
            ms = _number(retry_after_ms)
            secs = None if ms is None else ms / 1000.0
            out.retry_after = _bounded(
                out.notes, "retry-after", retry_after_ms, secs, 0.0, MAX_PAUSE
            )
        retry_after = get("retry-after")
        if out.retry_after is None and retry_after is not None:
            secs = parse_retry_after(retry_after, now_wall)
            out.retry_after = _bounded(out.notes, "retry-after", retry_after, secs, 0.0, MAX_PAUSE)
    return out


def _read(
    out: RateLimits,
    kind: str,
    limit: str | None,
    remaining: str | None,
    reset: str | None,
    now_wall: float | None,
) -> None:
    """One bucket's headers into `out.readings[kind]`, unless neither its limit nor what
    remains is readable. `now_wall`: resets are instants (Anthropic's), else durations."""
    notes = out.notes
    reading = Reading(
        _count(notes, "limit", limit, MIN_LIMIT), _count(notes, "remaining", remaining, 0.0)
    )
    if reading.limit is None and reading.remaining is None:
        return
    if reset is not None:
        secs = parse_duration(reset) if now_wall is None else parse_instant(reset, now_wall)
        if secs is None or not 0.0 <= secs <= MAX_RESET:
            secs = _bounded(notes, "reset", reset, secs, 0.0, MAX_RESET)
        reading.reset = secs
    out.readings[kind] = reading


def go_duration(seconds: float) -> str:
    """Formats like OpenAI's reset headers (Go durations): 12ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, secs = divmod(seconds, 60)
    s = f"{secs:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{s}s" if minutes else f"{s}s"


def learned_spec(old: Spec | None, reading: Reading | None) -> Spec | None:
    """Headers correct the configured (or earlier learned) bucket. `old` itself when they
    say what it says (most answers): the store fits a scope's buckets once per Limits."""
    if reading is None or reading.limit is None:
        return old
    rate = reading.limit / WINDOW
    depth = reading.capacity()
    if depth is None:
        depth = old.capacity if old is not None else rate * WINDOW
    # Same limit: the deepest estimate so far is the closest (estimates only undershoot).
    # (No max() of two numbers: ~700 instructions a call.)
    if old is not None and depth < old.capacity and math.isclose(old.rate, rate):
        depth = old.capacity
    if depth < 1.0:
        depth = 1.0
    if old is not None and old.rate == rate and old.capacity == depth:
        return old
    return Spec(rate, depth)


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
