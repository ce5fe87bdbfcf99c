"""Parsing of OpenAI, Anthropic and retry-after rate-limit headers."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from tokenpipe.control.ratelimit_headers import (
    Reading,
    go_duration,
    learned_spec,
    limit_names,
    parse,
    parse_duration,
    parse_instant,
    parse_retry_after,
)
from tokenpipe.control.store import Spec

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("6m0s", 360.0),
        ("1s", 1.0),
        ("12ms", 0.012),
        ("1.5s", 1.5),
        ("1h2m3.5s", 3723.5),
        ("250us", 0.00025),
        ("0s", 0.0),
        ("17", 17.0),
        ("0.25", 0.25),
    ],
)
def test_go_durations_and_bare_seconds_parse(text: str, seconds: float) -> None:
    got = parse_duration(text)
    assert got is not None and math.isclose(got, seconds)


@pytest.mark.parametrize("text", ["", "abc", "5x", "1s2", "m"])
def test_malformed_durations_are_rejected(text: str) -> None:
    assert parse_duration(text) is None


def test_go_duration_round_trips_through_the_parser() -> None:
    for seconds in (0.012, 0.5, 1.0, 59.25, 360.0, 3723.5):
        got = parse_duration(go_duration(seconds))
        assert got is not None and math.isclose(got, seconds, abs_tol=0.001)


def test_openai_headers_give_both_buckets_and_their_depth() -> None:
    info = parse(
        {
            "X-RateLimit-Limit-Requests": "600",
            "x-ratelimit-remaining-requests": "15",
            "x-ratelimit-reset-requests": "500ms",
            "x-ratelimit-limit-tokens": "150000",
            "x-ratelimit-remaining-tokens": "149000",
            "x-ratelimit-reset-tokens": "6m0s",
        },
        NOW,
    )
    r, t = info.requests, info.tokens
    assert r is not None and t is not None
    assert r.limit == 600 and r.remaining == 15 and r.reset == 0.5
    assert math.isclose(r.rate or 0, 10.0)
    assert r.capacity() == 20  # 15 left + 0.5 s of refill at 10/s: a 2-second-deep bucket
    assert t.capacity() == 150000  # never deeper than the per-minute limit
    assert info.retry_after is None


def test_depth_estimate_recovers_the_bucket_from_floored_remaining() -> None:
    # Level 14.7 of a 20-deep, 10/s bucket: the provider says remaining 14, reset 530ms.
    info = parse(
        {
            "x-ratelimit-limit-requests": "600",
            "x-ratelimit-remaining-requests": "14",
            "x-ratelimit-reset-requests": "530ms",
        },
        NOW,
    )
    assert info.requests is not None and info.requests.capacity() == 20


def test_anthropic_headers_with_rfc3339_resets() -> None:
    info = parse(
        {
            "anthropic-ratelimit-requests-limit": "50",
            "anthropic-ratelimit-requests-remaining": "49",
            "anthropic-ratelimit-requests-reset": "2026-01-02T03:04:06Z",
            "anthropic-ratelimit-input-tokens-limit": "30000",
            "anthropic-ratelimit-input-tokens-remaining": "29000",
            "anthropic-ratelimit-input-tokens-reset": "2026-01-02T03:04:07+00:00",
        },
        NOW,
    )
    assert info.requests is not None and info.requests.reset == 1.0
    assert info.tokens is not None  # input tokens stand in for a total
    assert info.tokens.limit == 30000 and info.tokens.reset == 2.0


def test_retry_after_ms_wins_over_retry_after() -> None:
    assert parse({"retry-after": "3", "retry-after-ms": "1250"}, NOW).retry_after == 1.25
    assert parse({"Retry-After": "3"}, NOW).retry_after == 3.0


def test_retry_after_as_http_date() -> None:
    assert parse_retry_after("Fri, 02 Jan 2026 03:04:15 GMT", NOW) == 10.0
    assert parse_retry_after("soon", NOW) is None


def test_no_rate_limit_headers_means_nothing_learned() -> None:
    info = parse({"content-type": "application/json", "x-ratelimit-remaining-requests": "x"}, NOW)
    assert not info


def test_openai_headers_win_over_anthropic_and_a_reset_alone_says_nothing() -> None:
    info = parse(
        {
            "X-RateLimit-Limit-Requests": "60",  # names are case-insensitive
            "anthropic-ratelimit-requests-limit": "50",
            "anthropic-ratelimit-requests-remaining": "49",
            "x-ratelimit-reset-tokens": "1s",  # no limit, no remaining: not a reading
            "anthropic-ratelimit-tokens-remaining": "900",
        },
        NOW,
    )
    assert info.requests is not None and info.requests.limit == 60
    assert info.requests.remaining is None  # not mixed with Anthropic's figures
    assert info.tokens is not None and info.tokens.remaining == 900 and info.tokens.reset is None


def test_anthropic_token_buckets_total_first_then_input_and_retry_after() -> None:
    info = parse(
        {
            "anthropic-ratelimit-tokens-limit": "80000",
            "anthropic-ratelimit-tokens-remaining": "79000",
            "anthropic-ratelimit-tokens-reset": "2026-01-02T03:04:35.500Z",
            "anthropic-ratelimit-input-tokens-limit": "40000",
            "anthropic-ratelimit-input-tokens-remaining": "39500",
            "anthropic-ratelimit-output-tokens-limit": "8000",
            "anthropic-ratelimit-output-tokens-remaining": "7900",
            "anthropic-ratelimit-output-tokens-reset": "2026-01-02T03:04:06Z",
            "retry-after": "7",
        },
        NOW,
    )
    assert info.tokens is not None and info.tokens.limit == 80000
    assert info.tokens.reset == 30.5
    assert info.readings["input-tokens"].remaining == 39500
    assert info.readings["output-tokens"].reset == 1.0
    assert info.retry_after == 7.0


@pytest.mark.parametrize(
    ("name", "value", "note"),
    [
        ("anthropic-ratelimit-requests-limit", "0", "limit"),  # would block it forever
        ("anthropic-ratelimit-requests-limit", "inf", "limit"),
        ("anthropic-ratelimit-requests-remaining", "-5", "remaining"),
        ("anthropic-ratelimit-tokens-remaining", "1e400", "remaining"),
        ("anthropic-ratelimit-tokens-reset", "soon", "reset"),
        ("anthropic-ratelimit-tokens-reset", "2026-01-02T03:04:05", "reset"),  # no time zone
        ("anthropic-ratelimit-tokens-reset", "2099-01-01T00:00:00Z", "reset"),  # clamped
        ("retry-after", "999999", "retry-after"),  # clamped to 60 s
    ],
)
def test_anthropic_values_out_of_range_are_dropped_or_clamped(
    name: str, value: str, note: str
) -> None:
    info = parse({"anthropic-ratelimit-tokens-limit": "10", name: value}, NOW)
    assert [kind for kind, _ in info.notes] == [note]
    for reading in info.readings.values():
        assert reading.limit is None or 1 <= reading.limit <= 1e12
        assert reading.remaining is None or 0 <= reading.remaining <= 1e12
        assert reading.reset is None or 0 <= reading.reset <= 86_400
    assert info.retry_after is None or info.retry_after <= 60


@pytest.mark.parametrize("kind", ["duration", "instant"])
def test_parsed_texts_are_remembered_within_a_bound(kind: str) -> None:
    """parse_duration and parse_instant keep their answers (the same resets come on every
    answer) in a memo that never holds more than its bound, and a remembered answer is the
    parsed one."""
    from tokenpipe.control import ratelimit_headers as rh

    def parsed(text: str) -> float | None:
        return parse_duration(text) if kind == "duration" else parse_instant(text, NOW)

    memo = rh._DURATIONS if kind == "duration" else rh._INSTANTS
    start = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()  # NOW
    for i in range(3 * rh.MEMO_MAX):
        if kind == "duration":
            assert parsed(f"{i}ms") == pytest.approx(i / 1000)
        else:
            text = datetime.fromtimestamp(start + i, UTC).isoformat().replace("+00:00", "Z")
            assert parsed(text) == parsed(text) == i
        assert len(memo) <= rh.MEMO_MAX
    if kind == "duration":
        assert parsed("6m0s") == parsed("6m0s") == 360.0
    else:  # the instant is kept, not the seconds from one moment
        assert parse_instant("2026-01-02T03:04:15Z", NOW) == 10.0
        assert parse_instant("2026-01-02T03:04:15Z", NOW + 4) == 6.0
        assert parse_instant("2026-01-02T03:04:15Z", NOW + 40) == 0.0
        assert parsed("2026-01-02T03:04:15") is None  # no time zone
    assert parsed("nonsense") is None and parsed("nonsense") is None
    long = "1s" * 20_000 if kind == "duration" else "2026-01-02T03:04:05Z" + " " * 40_000
    assert parsed(long) == (20_000.0 if kind == "duration" else 0.0)  # parsed, never kept
    assert long not in memo
    assert all(len(k) <= rh.MEMO_KEY_MAX for k in memo)


@pytest.mark.parametrize(
    "name",
    [
        "x-ratelimit-remaining-requests",
        "X-RateLimit-Limit-Tokens",
        "anthropic-ratelimit-tokens-remaining",
        "Anthropic-RateLimit-Input-Tokens-Limit",
        "retry-after",
        "Retry-After-Ms",
    ],
)
def test_a_head_naming_what_parse_reads_is_parsed(name: str) -> None:
    """The limiter parses only the heads `limit_names` picks: each header `parse` acts on,
    in any case, among others, in a plain dict and in the upstream's own multidict; and
    `parse` given those names reads as it does alone."""
    fields = [("content-type", "text/event-stream"), (name, "5"), ("x-request-id", "r")]
    for headers in (dict(fields), CIMultiDictProxy(CIMultiDict(fields))):
        names = limit_names(headers)
        assert names is not None
        info = parse(headers, NOW)
        assert info  # and parse reads it
        assert parse(headers, NOW, names) == info


def test_a_head_without_limits_is_not_parsed() -> None:
    fields = [
        ("content-type", "text/event-stream"),
        ("x-request-id", "ratelimit"),  # the word in a value, not a name
        ("x-ratelimited", "1"),
        ("date", "Mon, 07 Dec 2026 04:00:00 GMT"),
    ]
    for headers in ({}, dict(fields), CIMultiDictProxy(CIMultiDict(fields))):
        assert limit_names(headers) is None
        info = parse(headers, NOW)
        assert not info and not info.notes


def test_a_name_sent_twice_is_read_at_its_first_value() -> None:
    headers = CIMultiDict(
        [
            ("x-ratelimit-limit-requests", "60"),
            ("X-RateLimit-Limit-Requests", "600"),
            ("x-ratelimit-remaining-requests", "5"),
        ]
    )
    info = parse(headers, NOW)
    assert info.requests is not None and info.requests.limit == 60 and not info.notes


def test_a_reading_that_says_what_the_bucket_says_gives_back_the_same_spec() -> None:
    """learned_spec: the bucket the headers describe, and the very Spec it was given when
    they describe that one (the store refits its buckets whenever the Spec is another)."""
    assert learned_spec(None, None) is None
    first = learned_spec(None, Reading(600.0, 15.0, 0.5))  # 10/s, 15 left + 0.5 s of refill
    assert first == Spec(10.0, 20.0)
    assert learned_spec(first, Reading(600.0, 14.0, 0.6)) is first  # the same depth again
    assert learned_spec(first, Reading(600.0, 3.0, 0.1)) is first  # shallower: kept deeper
    assert learned_spec(first, Reading(600.0, 25.0, 0.5)) == Spec(10.0, 30.0)  # deeper
    assert learned_spec(first, Reading(1200.0, 15.0, 0.5)) == Spec(20.0, 25.0)  # new limit
    assert learned_spec(first, Reading(None, 15.0, 0.5)) is first  # no limit: nothing learned
    assert learned_spec(None, Reading(600.0)) == Spec(10.0, 600.0)  # no depth: the minute's
    assert learned_spec(None, Reading(30.0, 0.0, 0.0)) == Spec(0.5, 1.0)  # at least 1 deep
