"""An upstream's /v1/models past MAX_MODELS ids (real servers on loopback): its first ids are
kept, as a set (a model check compares a few ids, not each listed one), the rest ignored
with one log line; the gateway's GET /v1/models is rendered once per change of a list. A
4 MiB list held 100,000 ids: 5 ms of CPU a request, 166 ms a GET /v1/models."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.local_app import serving
from tokenpipe.clock import ManualClock
from tokenpipe.errors import GatewayError
from tokenpipe.front import models as front_models
from tokenpipe.gateway import running
from tokenpipe.router import Router
from tokenpipe.settings import Settings, UpstreamSettings
from tokenpipe.upstream.http import MAX_MODELS, MODELS_TTL, HttpUpstream

#: Ids past the bound in the long list.
PAST = 5


def _ids(n: int, prefix: str = "m") -> list[str]:
    """`n` ids in sorted order (the gateway's list is sorted)."""
    return [f"{prefix}{i:06d}" for i in range(n)]


class Upstream:
    """Lists `ids` at /v1/models (the test may change them); answers any chat request."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids
        self.asked = 0

    async def models(self, request: web.Request) -> web.Response:
        self.asked += 1
        return web.json_response({"object": "list", "data": [{"id": i} for i in self.ids]})

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        message = {"role": "assistant", "content": "ok"}
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": body.get("model"),
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        )


@pytest.fixture
async def served() -> AsyncIterator[tuple[Upstream, str]]:
    """The upstream, listing MAX_MODELS + PAST ids, and its base URL (`.../v1`)."""
    up = Upstream(_ids(MAX_MODELS + PAST))
    app = web.Application()
    app.router.add_get("/v1/models", up.models)
    app.router.add_post("/v1/chat/completions", up.chat)
    async with serving(app) as url:
        yield up, f"{url}/v1"


class Counted(str):
    """A model name that counts the comparisons made with it: a scan of a list compares it
    with every listed id; a set, with the ids of its hash only."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        Counted.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


async def _settled(upstream: HttpUpstream) -> None:
    """Until the background ask of the model list has ended (loop turns, no timed wait)."""
    async with asyncio.timeout(5):  # (a bound for the failure, not a wait)
        while len(upstream._models_flight):
            await asyncio.sleep(0)


async def test_a_list_past_the_bound_keeps_its_first_ids_and_logs_once(
    served: tuple[Upstream, str], caplog: pytest.LogCaptureFixture
) -> None:
    up, url = served
    clock = ManualClock()
    # (A name of its own: the line's budget is per upstream name, for the process.)
    upstream = HttpUpstream(UpstreamSettings(name="long-list", url=url), clock)
    try:
        with caplog.at_level(logging.WARNING, logger="tokenpipe.upstream"):
            listed = await upstream.listed_models()
            assert listed is not None and len(listed) == MAX_MODELS
            assert listed == set(up.ids[:MAX_MODELS])
            assert upstream.serves_now(up.ids[MAX_MODELS - 1]) is True
            assert upstream.serves_now(up.ids[MAX_MODELS]) is False  # past the bound
            clock.advance(MODELS_TTL)  # asked again (in the background): the same list
            assert upstream.serves_now(up.ids[0]) is True
            await _settled(upstream)
        assert up.asked == 2 and await upstream.listed_models() is listed  # unchanged: kept
        lines = [r.getMessage() for r in caplog.records if "long-list" in r.getMessage()]
        assert lines == [
            f"upstream long-list: its /models lists more than {MAX_MODELS} models: "
            f"the {PAST} entries after them are ignored"
        ]
    finally:
        await upstream.close()


async def test_a_model_check_compares_a_few_listed_ids_not_each(
    served: tuple[Upstream, str],
) -> None:
    up, url = served
    upstream = HttpUpstream(UpstreamSettings(name="u", url=url))
    router = Router([upstream])
    try:
        assert await upstream.serves("m000000")  # the list learned
        for name in ("absent", up.ids[MAX_MODELS - 1]):
            Counted.compared = 0
            assert upstream.serves_now(Counted(name)) is (name != "absent")
            assert Counted.compared <= 3, name  # ("*" in the config, and a hash's ids)
        Counted.compared = 0
        with pytest.raises(GatewayError):
            await router.candidates(Counted("absent"))
        assert Counted.compared <= 3
    finally:
        await router.close()


async def test_the_gateway_lists_and_routes_the_kept_ids_only(
    served: tuple[Upstream, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /v1/models: the first MAX_MODELS ids, rendered once for any number of calls."""
    up, url = served
    rendered = 0
    render = front_models._openai_model

    def counted(name: str) -> dict[str, object]:
        nonlocal rendered
        rendered += 1
        return render(name)

    monkeypatch.setattr(front_models, "_openai_model", counted)
    settings = Settings(upstreams=[UpstreamSettings(name="u", url=url)])
    settings.server.port = 0
    async with running(settings) as (*_, port), aiohttp.ClientSession() as s:
        base = f"http://{settings.server.host}:{port}"
        for _ in range(3):  # a client polling the list
            async with s.get(base + "/v1/models") as r:
                assert r.status == 200
                listed: dict[str, Any] = await r.json()
            assert [m["id"] for m in listed["data"]] == up.ids[:MAX_MODELS]
        assert rendered == MAX_MODELS  # once, not once a call
        async with s.get(base + "/v1/models/" + up.ids[MAX_MODELS - 1]) as r:
            assert r.status == 200
        for model, status in ((up.ids[MAX_MODELS - 1], 200), (up.ids[MAX_MODELS], 404)):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            async with s.post(base + "/v1/chat/completions", json=body) as r:
                assert r.status == status, await r.text()


async def test_the_listing_is_built_again_when_a_list_changes_only(
    served: tuple[Upstream, str],
) -> None:
    up, url = served
    up.ids = ["b", "a"]
    clock = ManualClock()
    upstream = HttpUpstream(UpstreamSettings(name="u", url=url, models=["*", "c"]), clock)
    router = Router([upstream])
    try:
        first = await router.models()
        assert first.names == ("a", "b", "c") and await router.models() is first
        clock.advance(MODELS_TTL)  # asked again: the same ids, in another order
        up.ids = ["a", "b"]
        await router.models()
        await _settled(upstream)
        assert up.asked == 2 and await router.models() is first
        clock.advance(MODELS_TTL)  # asked again: another list
        up.ids = ["a", "d"]
        assert await router.models() is first  # the last list, while asked again
        await _settled(upstream)
        again = await router.models()
        assert again.names == ("a", "c", "d") and again.known == {"a", "c", "d"}
    finally:
        await router.close()
