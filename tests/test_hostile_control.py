"""Hostile upstream rate-limit headers, hostile max_tokens and unbounded metric labels
(issue 16, items 3-5): unit tables for the header parser, then the gateway on real sockets
in front of a small upstream of our own that says whatever a test wants."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests import procs
from tokenpipe.clock import ManualClock
from tokenpipe.control.bounds import MAX_PAUSE, ClampLog
from tokenpipe.control.bucket import MAX_DEBT, TokenBucket
from tokenpipe.control.ratelimit_headers import parse, parse_duration
from tokenpipe.control.store import Limits, MemoryStore, Spec

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()


# -- the parser, table-driven ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "retry_after"),
    [
        ({"retry-after": "999999"}, MAX_PAUSE),
        ({"retry-after": "inf"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "-5"}, None),
        ({"retry-after": "Thu, 01 Jan 2099 00:00:00 GMT"}, MAX_PAUSE),
        ({"retry-after-ms": "9e18"}, MAX_PAUSE),
        ({"retry-after-ms": "-inf"}, None),
        ({"retry-after-ms": "garbage", "retry-after": "2"}, 2.0),
        ({"retry-after": "1.5"}, 1.5),
    ],
)
def test_retry_after_is_capped_at_60_s_and_non_finite_or_negative_is_ignored(
    headers: dict[str, str], retry_after: float | None
) -> None:
    assert parse(headers, NOW).retry_after == retry_after


@pytest.mark.parametrize(
    ("value", "limit"),
    [("inf", None), ("nan", None), ("0", None), ("-1e18", None), ("1e300", 1e12), ("600", 600.0)],
)
def test_a_limit_is_finite_at_least_one_and_bounded(value: str, limit: float | None) -> None:
    info = parse({"x-ratelimit-limit-requests": value, "x-ratelimit-remaining-requests": "5"}, NOW)
    assert info.requests is not None and info.requests.limit == limit
    if limit is None:
        assert info.notes and info.notes[0][0] == "limit"


@pytest.mark.parametrize("value", ["-1e18", "-inf", "inf", "nan", "-1"])
def test_a_negative_or_non_finite_remaining_is_ignored(value: str) -> None:
    info = parse({"x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": value}, NOW)
    assert info.tokens is not None and info.tokens.remaining is None
    assert info.tokens.capacity() == 1000  # nothing overflows (inf gave a 500)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("6m0s", 360.0), ("1e9s", None), ("garbage", None), ("1e999", None), ("99999999h", 86400.0)],
)
def test_reset_durations_are_parsed_and_bounded(text: str, seconds: float | None) -> None:
    info = parse(
        {
            "x-ratelimit-limit-tokens": "1000",
            "x-ratelimit-remaining-tokens": "10",
            "x-ratelimit-reset-tokens": text,
        },
        NOW,
    )
    assert info.tokens is not None and info.tokens.reset == seconds
    assert parse_duration("1e999") is None


def test_clamp_log_says_one_line_per_upstream_and_kind_per_minute() -> None:
    import logging

    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test.clamp")
    logger.addHandler(Grab())
    clock = ManualClock()
    clamp = ClampLog(logger, clock)
    notes = parse({"retry-after": "999999"}, NOW).notes
    for _ in range(1000):
        clamp.report("up", notes)
    clamp.report("other-up", notes)
    assert len(records) == 2 and "clamped to 60" in records[0]
    clock.advance(61)
    clamp.report("up", notes)
    assert len(records) == 3 and "999 more" in records[2]


def test_a_bucket_carries_at_most_two_depths_of_debt() -> None:
    clock = ManualClock()
    b = TokenBucket(rate=10, capacity=20, clock=clock)
    assert b.reserve(9.2e18) == 0.0
    assert b.level == -MAX_DEBT * 20
    b.set_level(-1e18)
    assert b.wait_for(1) <= (MAX_DEBT + 1) * 20 / 10


def test_a_store_pause_is_capped_and_nan_or_inf_levels_are_ignored() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    limits = Limits(Spec(10, 20), Spec(100, 1000))
    store.pause_now("up:x", math.inf)
    store.learn_now("up:x", limits, math.nan, -math.inf, None)
    assert store.reserve_now("up:x", limits, 1).wait == MAX_PAUSE
    store.pause_now("up:y", math.nan)
    assert store.reserve_now("up:y", limits, 1).wait == 0.0


# -- a hostile upstream on a real socket ----------------------------------------------------

HOSTILE_200 = {
    "x-ratelimit-limit-requests": "inf",
    "x-ratelimit-remaining-requests": "-1e18",
    "x-ratelimit-limit-tokens": "0",
    "x-ratelimit-remaining-tokens": "-inf",
    "x-ratelimit-reset-tokens": "1e9s",
    "x-ratelimit-reset-requests": "garbage",
}


class Upstream:
    """Answers chat completions; the first `storm` answers are 429 with `retry_headers`."""

    def __init__(self) -> None:
        self.storm = 0
        self.retry_headers: dict[str, str] = {}
        self.hostile = True
        self.url = ""

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.storm > 0:
            self.storm -= 1
            return web.json_response(
                {"error": {"message": "slow down", "type": "rate_limit_error"}},
                status=429,
                headers=self.retry_headers,
            )
        answer = {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3},
        }
        return web.json_response(answer, headers=HOSTILE_200 if self.hostile else {})

    async def models(self, request: web.Request) -> web.Response:
        return web.Response(status=404)  # lists no models: any name is forwarded


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", up.chat)
    app.router.add_get("/v1/models", up.models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    up.url = f"http://127.0.0.1:{port}/v1"
    yield up
    await runner.cleanup()


def _body(model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def _config(tmp_path: Path, up: Upstream, extra: str = "") -> str:
    path = tmp_path / "tokenpipe.yaml"
    path.write_text(
        f"upstreams:\n  - name: hostile\n    url: {up.url}\n"
        "limits:\n  queue_deadline_seconds: 3\n" + extra
    )
    return str(path)


async def test_hostile_rate_limit_headers_never_wedge_the_upstream(
    upstream: Upstream, tmp_path: Path
) -> None:
    upstream.storm = 1
    upstream.retry_headers = {"retry-after": "inf", "x-ratelimit-limit-requests": "inf"}
    with procs.gateway("--config", _config(tmp_path, upstream)) as gw:
        url = gw.url + "/v1/chat/completions"
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json=_body()) as r:
                await r.read()  # the 429 (or a retry's 200): either is fine, no 500
                assert r.status in (200, 429), r.status
            t = time.monotonic()
            for _ in range(5):  # 200s carrying limit inf / remaining -1e18 / limit 0
                async with s.post(url, json=_body()) as r:
                    assert r.status == 200, await r.text()
            assert time.monotonic() - t < 5.0  # the upstream was never paused for long
            # A 999999 s retry-after holds the upstream at most 60 s: the next request is told
            # to come back within the queue deadline, not in 11 days.
            upstream.storm, upstream.retry_headers = 1, {"retry-after": "999999"}
            async with s.post(url, json=_body()) as r:
                await r.read()
            async with s.post(url, json=_body()) as r:
                await r.read()
                if r.status == 429:
                    assert float(r.headers["Retry-After"]) <= MAX_PAUSE
        gw.stop()
        out = gw.output()
    assert "out of range" in out and "pausing it for 60 s" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


async def test_a_huge_max_tokens_is_refused_and_never_locks_the_key_out(
    upstream: Upstream, tmp_path: Path
) -> None:
    upstream.hostile = False
    cfg = _config(tmp_path, upstream, 'keys:\n  "*": {tpm: 6000}\n')
    with procs.gateway("--config", cfg) as gw:
        url = gw.url + "/v1/chat/completions"
        async with aiohttp.ClientSession() as s:
            for huge in (9223372036854775807, 1_000_000_000, 20_000):
                async with s.post(url, json=_body(max_tokens=huge)) as r:
                    err = await r.json()
                    assert r.status == 400, err
                    assert err["error"]["param"] == "max_tokens", err
            for _ in range(3):  # everyone else (here: the same anonymous key) still gets in
                async with s.post(url, json=_body(max_tokens=100)) as r:
                    assert r.status == 200, (r.status, dict(r.headers), await r.text())


async def test_a_key_is_charged_what_its_usage_says_not_its_max_tokens(
    upstream: Upstream, tmp_path: Path
) -> None:
    """Five requests that each reserve 4,000 of a 6,000-token minute but use 3 tokens (the
    upstream's usage): charged by max_tokens the second would be refused; by usage all pass."""
    upstream.hostile = False
    cfg = _config(tmp_path, upstream, 'keys:\n  "*": {tpm: 6000}\n')
    with procs.gateway("--config", cfg) as gw:
        url = gw.url + "/v1/chat/completions"
        async with aiohttp.ClientSession() as s:
            for _ in range(5):
                async with s.post(url, json=_body(max_tokens=4000)) as r:
                    assert r.status == 200, (r.status, dict(r.headers), await r.text())


async def test_3000_client_model_names_keep_metrics_under_1_mb(
    upstream: Upstream, tmp_path: Path
) -> None:
    upstream.hostile = False
    with procs.gateway("--config", _config(tmp_path, upstream)) as gw:
        url = gw.url + "/v1/chat/completions"
        conn = aiohttp.TCPConnector(limit=32)
        async with aiohttp.ClientSession(connector=conn) as s:

            async def one(i: int) -> int:
                async with s.post(url, json=_body(f"client-model-{i}")) as r:
                    await r.read()
                    return r.status

            statuses = await asyncio.gather(*(one(i) for i in range(3000)))
            assert set(statuses) == {200}
            async with s.get(gw.url + "/metrics") as r:
                text = await r.text()
    assert len(text.encode()) < 1_000_000, len(text)
    assert 'model="other"' in text
    assert "client-model-" not in text
