"""Which upstreams serve a model (router/candidates.py): the configured names looked up by
API and model, the upstreams that take any model ("*") asked by their own /v1/models, and
the answer in config order whichever way each was found."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web

from tests.local_app import serving
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics
from tokenpipe.router import Router
from tokenpipe.settings import UpstreamSettings
from tokenpipe.upstream.http import HttpUpstream


@pytest.fixture(autouse=True)
def model_labels() -> Iterator[None]:
    """A router makes its configured names metric labels, of which a process keeps at most
    MAX_MODEL_LABELS: the names these tests configure are not left to crowd out others'."""
    before = set(metrics._models)
    yield
    metrics._models.intersection_update(before)


@pytest.fixture
async def listing_url() -> AsyncIterator[str]:
    """An upstream whose /v1/models lists m1 and m2."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serving(app) as url:
        yield f"{url}/v1"


def _upstream(name: str, url: str, models: list[str], api: str = "openai") -> HttpUpstream:
    return HttpUpstream(UpstreamSettings(name=name, url=url, models=models, api=api))


async def test_candidates_are_in_config_order_however_each_was_found(listing_url: str) -> None:
    none = "http://127.0.0.1:9/v1"  # never asked: these name their models
    ups = [
        _upstream("a", none, ["m1", "m1"]),  # a name listed twice
        _upstream("any", listing_url, ["*"]),  # lists m1 and m2
        _upstream("claude", none, ["m1"], api="anthropic"),
        _upstream("c", none, ["m2", "m1"]),
        _upstream("any-and-m3", listing_url, ["m3", "*"]),
    ]
    router = Router(ups)
    try:
        names = [u.name for u in await router.candidates("m1")]
        assert names == ["a", "any", "c", "any-and-m3"]
        assert [u.name for u in await router.candidates("m2")] == ["any", "c", "any-and-m3"]
        assert [u.name for u in await router.candidates("m3")] == ["any-and-m3"]
        assert [u.name for u in await router.candidates("m1", "anthropic")] == ["claude"]
        first = await router.candidates("m1")
        first.clear()  # a caller's list is its own
        assert len(await router.candidates("m1")) == 4
        for model, api in (("m9", "openai"), ("m2", "anthropic"), ("m1", "responses")):
            with pytest.raises(GatewayError) as e:
                await router.candidates(model, api)
            assert e.value.status == 404 and e.value.code == "model_not_found"
    finally:
        await router.close()


async def test_an_upstream_naming_its_models_is_never_asked_for_its_list() -> None:
    up = _upstream("a", "http://127.0.0.1:9/v1", [f"named-{i}" for i in range(2_000)])
    router = Router([up])
    try:
        assert await router.candidates("named-1999") == [up]
        assert up.serves_now("named-1999") is True and up.serves_now("other") is False
        with pytest.raises(GatewayError):
            await router.candidates("other")
    finally:
        await router.close()
