"""Single flight (flight.py): the callers that need one lookup while it runs share it and
wake together, and the lookups a cold burst meets use it: the upstream's model list, the
context windows it serves (real upstream servers on loopback), a model's token counter."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import pytest
from aiohttp import web

from tests.local_app import serving
from tokenpipe import pipeline
from tokenpipe.clock import ManualClock
from tokenpipe.context.lookup import ModelLookup
from tokenpipe.context.windows import DISCOVERY_TTL, WindowDiscovery
from tokenpipe.flight import SingleFlight
from tokenpipe.gateway import running
from tokenpipe.router import Router
from tokenpipe.settings import Settings, UpstreamSettings
from tokenpipe.upstream.http import MODELS_RETRY, MODELS_TTL, HttpUpstream

#: Callers at once, as a cold burst's first requests.
BURST = 200


async def _all_done_with_the_first(tasks: Sequence[asyncio.Task[Any]]) -> bool:
    """Whether every task had ended by the time the first one's end was seen. Waiters queued
    on a lock end one per turn of the event loop; waiters of one flight, in the same turn."""
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finished = sum(1 for t in tasks if t.done())
    await asyncio.gather(*tasks)
    return finished == len(tasks)


async def test_callers_of_one_key_share_one_run_and_wake_together() -> None:
    runs: list[str] = []
    gate = asyncio.Event()

    async def look(key: str) -> str:
        runs.append(key)
        await gate.wait()
        return key.upper()

    flight: SingleFlight[str] = SingleFlight()
    tasks = [asyncio.create_task(flight.do("a", lambda: look("a"))) for _ in range(BURST)]
    other = asyncio.create_task(flight.do("b", lambda: look("b")))
    while len(runs) < 2:  # both runs started (loop turns, no timed wait)
        await asyncio.sleep(0)
    assert len(flight) == 2
    gate.set()
    assert await _all_done_with_the_first(tasks)
    assert [t.result() for t in tasks] == ["A"] * BURST and await other == "B"
    assert sorted(runs) == ["a", "b"] and len(flight) == 0  # one run per key, then forgotten
    assert await flight.do("a", lambda: look("a")) == "A" and runs.count("a") == 2  # no cache


async def test_a_caller_that_gives_up_leaves_the_run_to_the_others() -> None:
    gate = asyncio.Event()
    runs = 0

    async def look() -> int:
        nonlocal runs
        runs += 1
        await gate.wait()
        return 7

    flight: SingleFlight[int] = SingleFlight()
    first = asyncio.create_task(flight.do("k", look))
    second = asyncio.create_task(flight.do("k", look))
    while runs == 0:
        await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    gate.set()
    assert await second == 7 and runs == 1


async def test_an_error_reaches_every_caller_and_the_next_call_runs_again() -> None:
    calls = 0

    async def failing() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        raise ValueError("no")

    flight: SingleFlight[int] = SingleFlight()
    got = await asyncio.gather(*(flight.do("k", failing) for _ in range(5)), return_exceptions=True)
    assert calls == 1 and all(isinstance(e, ValueError) for e in got)
    with pytest.raises(ValueError):
        await flight.do("k", failing)
    assert calls == 2


def _models_app(gate: asyncio.Event, asked: list[str]) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        asked.append(request.path)
        await gate.wait()  # every caller is waiting before the list comes
        return web.json_response({"data": [{"id": "m1", "max_model_len": 8192}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    return app


def _serves(upstream: HttpUpstream) -> Callable[[], Coroutine[Any, Any, object]]:
    return lambda: upstream.serves("m1")


def _window(upstream: HttpUpstream) -> Callable[[], Coroutine[Any, Any, object]]:
    found = WindowDiscovery()  # one, shared by the burst
    return lambda: found.window(upstream, "m1")


@pytest.mark.parametrize(("asker", "answer"), [(_serves, True), (_window, 8192)])
async def test_a_cold_burst_asks_the_upstream_for_its_models_once_and_wakes_together(
    asker: Callable[[HttpUpstream], Callable[[], Coroutine[Any, Any, object]]], answer: object
) -> None:
    """The model check (`serves`) and the window discovery: one /v1/models for the burst."""
    gate, asked = asyncio.Event(), list[str]()
    async with serving(_models_app(gate, asked)) as url:
        upstream = HttpUpstream(UpstreamSettings(name="u", url=f"{url}/v1"))
        ask = asker(upstream)
        try:
            tasks = [asyncio.create_task(ask()) for _ in range(BURST)]
            while not asked:  # the one request reached the upstream
                await asyncio.sleep(0)
            gate.set()
            assert await _all_done_with_the_first(tasks)
            assert [t.result() for t in tasks] == [answer] * BURST and asked == ["/v1/models"]
        finally:
            await upstream.close()


async def _settled(upstream: HttpUpstream, windows: WindowDiscovery) -> None:
    """Until the background asks of the model list and the windows have ended."""
    while len(upstream._models_flight) or len(windows._fetching):
        await asyncio.sleep(0)


async def test_an_old_model_list_and_window_answer_at_once_while_asked_again() -> None:
    """Once known, the upstream's model list and windows stay the answer: past their TTL they
    are asked for again in the background. Before, the first request to find them old
    waited for the upstream's /models, and so did every request that came meanwhile."""
    gate, asked = asyncio.Event(), list[str]()
    gate.set()
    clock = ManualClock()
    async with serving(_models_app(gate, asked)) as url:
        upstream = HttpUpstream(UpstreamSettings(name="u", url=f"{url}/v1"), clock)
        windows = WindowDiscovery(clock)
        try:
            known = upstream.serves("m1"), windows.window(upstream, "m1")
            assert await asyncio.gather(*known) == [True, 8192]  # one ask, shared
            assert asked == ["/v1/models"]
            gate.clear()  # the upstream holds its next answer
            clock.advance(max(MODELS_TTL, DISCOVERY_TTL) + 1)
            assert upstream.serves_now("m1") is True  # known: nothing to wait for
            async with asyncio.timeout(5):  # (a bound for the failure, not a wait)
                assert await windows.window(upstream, "m1") == 8192
            while len(asked) < 2:  # asked again, once for both
                await asyncio.sleep(0)
            gate.set()
            await _settled(upstream, windows)
            assert asked == ["/v1/models"] * 2 and upstream.serves_now("m1") is True
            assert not len(upstream._models_flight)  # fresh again: no new ask
        finally:
            await upstream.close()


async def test_a_failed_ask_again_keeps_the_last_model_list_and_windows() -> None:
    asked: list[int] = []

    async def models(request: web.Request) -> web.Response:
        asked.append(1)
        if len(asked) > 1:
            return web.json_response({"error": "down"}, status=503)
        return web.json_response({"data": [{"id": "m1", "max_model_len": 8192}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    clock = ManualClock()
    async with serving(app) as url:
        upstream = HttpUpstream(UpstreamSettings(name="u", url=f"{url}/v1"), clock)
        windows = WindowDiscovery(clock)
        try:
            known = upstream.serves("m1"), windows.window(upstream, "m1")
            assert await asyncio.gather(*known) == [True, 8192]  # one ask, shared
            clock.advance(max(MODELS_TTL, DISCOVERY_TTL) + 1)
            assert upstream.serves_now("other") is False  # the last list, not "any model"
            assert await windows.window(upstream, "m1") == 8192
            await _settled(upstream, windows)
            assert len(asked) == 2  # the ask again failed
            assert upstream.serves_now("m1") is True and upstream.serves_now("other") is False
            assert await windows.window(upstream, "m1") == 8192
            assert not len(upstream._models_flight)  # not asked again before MODELS_RETRY
            clock.advance(MODELS_RETRY)
            upstream.serves_now("m1")
            assert len(upstream._models_flight) == 1
            await _settled(upstream, windows)
        finally:
            await upstream.close()


async def test_the_model_check_and_the_window_discovery_share_one_models_request() -> None:
    gate, asked = asyncio.Event(), list[str]()
    async with serving(_models_app(gate, asked)) as url:
        upstream = HttpUpstream(UpstreamSettings(name="u", url=f"{url}/v1"))
        try:
            served = asyncio.create_task(upstream.serves("m1"))
            window = asyncio.create_task(WindowDiscovery().window(upstream, "m1"))
            while not asked:
                await asyncio.sleep(0)
            gate.set()
            assert await served and await window == 8192 and asked == ["/v1/models"]
        finally:
            await upstream.close()


async def test_a_cold_burst_loads_a_models_token_counter_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lookup = ModelLookup({}, Router([]))
    with caplog.at_level(logging.INFO, logger="tokenpipe.context"):
        counters = await asyncio.gather(*(lookup.counter("gpt-4o") for _ in range(BURST)))
    assert all(c is counters[0] for c in counters)
    loads = [r for r in caplog.records if "counts tokens with" in r.getMessage()]
    assert len(loads) == 1  # one worker-thread load, not one per request


def _models_then(statuses: list[int], asked: list[int]) -> web.Application:
    """/v1/models answering each of `statuses` in turn (an upstream still starting: 503),
    then the list; every ask recorded."""

    async def models(request: web.Request) -> web.Response:
        asked.append(1)
        if len(asked) <= len(statuses):
            return web.json_response({"error": "starting"}, status=statuses[len(asked) - 1])
        return web.json_response({"data": [{"id": "m1", "max_model_len": 8192}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    return app


async def test_the_warm_up_marks_nothing_when_the_upstream_cannot_say_yet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failed warm-up ask leaves the first request to ask itself (a request's failed ask
    means "serves any model" for MODELS_RETRY), and logs nothing: a starting upstream."""
    asked = list[int]()
    async with serving(_models_then([503], asked)) as url:
        upstream = HttpUpstream(UpstreamSettings(name="u", url=f"{url}/v1"))
        try:
            with caplog.at_level(logging.WARNING, logger="tokenpipe"):
                assert await upstream.warm() is None
            assert upstream.serves_now("m1") is None and caplog.records == []
            assert await upstream.warm() == {"data": [{"id": "m1", "max_model_len": 8192}]}
            assert upstream.serves_now("m1") is True and upstream.serves_now("m2") is False
        finally:
            await upstream.close()


async def test_a_gateway_learns_its_upstreams_models_and_windows_before_the_first_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At start, asked again while the upstream cannot say (twice here); then its first
    request finds the model list and the window known, and asks nothing."""
    monkeypatch.setattr(pipeline, "WARM_FIRST_PAUSE", 0.001)
    asked = list[int]()
    async with serving(_models_then([503, 503], asked)) as url:
        settings = Settings(upstreams=[UpstreamSettings(name="u", url=f"{url}/v1")])
        async with running(settings) as (front, _, _):
            gw = front.gateway
            upstream = gw.router.upstreams[0]
            async with asyncio.timeout(5):  # (a bound for the failure, not a wait)
                while upstream.serves_now("m1") is None:  # until learned: loop turns
                    await asyncio.sleep(0)
            assert upstream.serves_now("m1") is True and upstream.serves_now("m2") is False
            # The cold concurrency limit waits for a request's answer (its rate-limit
            # headers) even on loopback: control/limiter.py.
            concurrency = gw.traffic.limiters["u"].concurrency
            assert upstream.private and concurrency and concurrency.limit == 32
            assert await gw.context.lookup.window("m1") == 8192
            assert len(asked) == 3  # the window was known: not asked for again


async def test_windows_the_upstream_could_not_say_are_asked_for_again_after_the_retry() -> None:
    """Not after DISCOVERY_TTL: one failed ask left the upstream's models unbudgeted for a
    minute (and a failed ask at start would have done the same)."""
    asked = list[int]()
    clock = ManualClock()
    async with serving(_models_then([503], asked)) as url:
        upstream = HttpUpstream(UpstreamSettings(name="u", url=f"{url}/v1"), clock)
        windows = WindowDiscovery(clock)
        try:
            assert await windows.window(upstream, "m1") is None
            clock.advance(MODELS_RETRY)
            assert await windows.window(upstream, "m1") is None  # asked again, meanwhile
            await _settled(upstream, windows)
            assert await windows.window(upstream, "m1") == 8192 and len(asked) == 2
        finally:
            await upstream.close()
