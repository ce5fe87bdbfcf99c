"""`upstreams[].responses: auto` (the default): the gateway asks an upstream once whether it has
/responses and then passes /v1/responses through natively, or translates it to chat. On
loopback with two sims, one serving the Responses API and one without it (`--no-responses`,
a 404 there like llama.cpp or the embedded model); the cache itself on a fake clock."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from tests import procs
from tests.responses_events import check_events, check_response, parse, text_of
from tokenpipe.settings import UpstreamSettings
from tokenpipe.upstream import responses_probe
from tokenpipe.upstream.http import HttpUpstream
from tokenpipe.upstream.responses_probe import RETRY, TTL, ResponsesProbe, verdict

_PROBED = re.compile(r"POST /responses answered (\d+)")


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, procs.Service]]:
    """A sim that serves /v1/responses and one that answers 404 there, each behind a gateway
    with the default settings (`--upstream URL`: `responses: auto`)."""
    args = ("--ttft-ms", "5", "--itl-ms", "1", "--output-tokens", "12")
    with (
        procs.sim(*args) as served,
        procs.sim(*args, "--no-responses") as chat_only,
        procs.gateway("--upstream", served.url + "/v1") as served_gw,
        procs.gateway("--upstream", chat_only.url + "/v1") as chat_only_gw,
    ):
        yield {
            "served": served,
            "chat-only": chat_only,
            "served-gw": served_gw,
            "chat-only-gw": chat_only_gw,
        }


async def _kinds(sim: procs.Service) -> list[str]:
    """The API of each request the sim was sent, oldest first."""
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/stats?last=1000") as r:
        return [rec["kind"] for rec in (await r.json())["records"]]


async def _stream(gw: procs.Service) -> list[dict[str, Any]]:
    body = {"model": "sim-model", "input": "hello", "stream": True}
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/responses", json=body) as r:
        assert r.status == 200, await r.text()
        return parse(await r.read())


@pytest.mark.parametrize(
    ("name", "kind", "status"), [("served", "responses", 400), ("chat-only", "chat", 404)]
)
async def test_auto_passes_through_where_served_and_translates_where_not_asking_once(
    sims: dict[str, procs.Service], name: str, kind: str, status: int
) -> None:
    sim, gw = sims[name], sims[f"{name}-gw"]
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    whole = await client.responses.with_raw_response.create(model="sim-model", input="hello")
    got = check_response(whole.http_response.json())
    assert got.status == "completed" and len(got.output_text.split()) == 12
    events = await _stream(gw)
    check_events(events)
    assert len(text_of(events).split()) == 12
    # A burst after the first: the cached answer, no second question.
    await asyncio.gather(*(_stream(gw) for _ in range(4)))
    assert await _kinds(sim) == [kind] * 6
    assert [int(s) for s in _PROBED.findall(gw.output())] == [status]


async def test_a_cold_burst_asks_once_and_no_request_fails(tmp_path: Any) -> None:
    """Requests that arrive while the first asks do not wait for its answer: they are
    translated (chat is served by every OpenAI upstream), and the question is asked once."""
    with (
        procs.sim("--ttft-ms", "5", "--itl-ms", "1", "--output-tokens", "5") as sim,
        procs.gateway("--upstream", sim.url + "/v1") as gw,
    ):
        bursts = await asyncio.gather(*(_stream(gw) for _ in range(6)))
        for events in bursts:
            assert events[-1]["type"] == "response.completed"
        kinds = await _kinds(sim)
        assert len(kinds) == 6 and set(kinds) <= {"responses", "chat"}
        assert kinds.count("responses") >= 1  # the request that asked (and any after it)
        assert _PROBED.findall(gw.output()) == ["400"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Upstream:
    """Answers the probe with the next status (None: no answer), counting the questions;
    `gate` holds an answer back until it is set."""

    def __init__(self, *statuses: int | None) -> None:
        self.statuses = list(statuses)
        self.asked: list[float] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, timeout: float) -> int | None:
        self.asked.append(timeout)
        await self.gate.wait()
        return self.statuses.pop(0)


@pytest.mark.parametrize(
    ("status", "served"),
    [(400, True), (422, True), (200, True), (404, False), (405, False), (501, False)]
    + [(s, None) for s in (None, 401, 403, 429, 500, 502, 503)],
)
def test_what_an_answer_says(status: int | None, served: bool | None) -> None:
    assert verdict(status) is served


async def test_an_answer_is_kept_for_the_ttl_and_then_asked_again() -> None:
    clock, upstream = FakeClock(), Upstream(400, 404)
    probe = ResponsesProbe(upstream, clock)
    assert probe.now() is None  # not asked yet: the caller asks
    assert await probe.served() is True
    for _ in range(3):
        assert probe.now() is True and await probe.served() is True
    clock.now = TTL - 1
    assert await probe.served() is True and len(upstream.asked) == 1
    clock.now = TTL + 1
    upstream.gate.clear()
    assert probe.now() is True  # due: the last answer, asked again in the background
    assert await probe.served() is True and probe.now() is True  # (one question at a time)
    upstream.gate.set()
    assert probe._again is not None and await probe._again is False
    assert probe.now() is False  # the upstream changed its mind
    assert len(upstream.asked) == 2 and upstream.asked == [responses_probe.TIMEOUT] * 2


async def test_an_answer_that_says_nothing_is_chat_until_retry_and_keeps_the_last_answer() -> None:
    clock, upstream = FakeClock(), Upstream(503, 400, None)
    probe = ResponsesProbe(upstream, clock)
    assert await probe.served() is False
    clock.now = RETRY - 1
    assert probe.now() is False and len(upstream.asked) == 1
    clock.now = RETRY + 1
    assert await probe.served() is True
    clock.now += TTL + 1
    assert await probe.served() is True  # asked again in the background
    assert probe._again is not None and await probe._again is True
    assert probe.answer is True and len(upstream.asked) == 3  # no answer: the last stands
    assert probe.now() is True and len(upstream.asked) == 3  # not asked before RETRY
    clock.now += RETRY + 1
    upstream.statuses.append(404)
    assert probe.now() is True  # then asked again
    assert await probe._again is False and len(upstream.asked) == 4


async def test_only_one_request_waits_for_the_answer() -> None:
    upstream = Upstream(400)
    upstream.gate.clear()
    probe = ResponsesProbe(upstream, FakeClock())
    first = asyncio.create_task(probe.served(limit=0.5))
    await asyncio.sleep(0)
    assert upstream.asked == [0.5]  # the request's own time left, below TIMEOUT
    assert probe.now() is False  # the others: chat, at once
    assert await probe.served() is False and len(upstream.asked) == 1
    upstream.gate.set()
    assert await first is True and probe.now() is True


async def test_a_request_cancelled_while_asking_leaves_the_question_to_the_next() -> None:
    upstream = Upstream(404, 400)
    upstream.gate.clear()
    probe = ResponsesProbe(upstream, FakeClock())
    first = asyncio.create_task(probe.served())
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    upstream.statuses.pop(0)
    upstream.gate.set()
    assert probe.now() is None
    assert await probe.served() is True and len(upstream.asked) == 2


async def test_native_and_chat_are_never_asked_and_an_unreachable_upstream_is_chat() -> None:
    closed = "http://127.0.0.1:9/v1"  # discard: nothing listens
    for mode, want in (("native", True), ("chat", False)):
        u = HttpUpstream(UpstreamSettings(name="u", url=closed, responses=mode))
        assert u.serves_responses_now() is want and await u.serves_responses() is want
        assert u._pool is None  # no connection was ever opened
    u = HttpUpstream(UpstreamSettings(name="u", url=closed))
    assert u.settings.responses == "auto" and u.serves_responses_now() is None
    assert await u.serves_responses() is False
    assert u.serves_responses_now() is False  # not asked again before RETRY
    await u.close()
