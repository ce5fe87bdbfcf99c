"""An upstream's /v1/models is asked once per TTL: a cold burst shares one request, and an
upstream without the route is not asked again in front of every completion."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from tests.local_app import serving
from tokenpipe.settings import UpstreamSettings
from tokenpipe.upstream.http import HttpUpstream


class Models:
    def __init__(self) -> None:
        self.hits = 0
        self.status = 200
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        self.asked.set()
        await self.release.wait()  # the test decides when the answer leaves
        if self.status != 200:
            return web.json_response({"error": {"message": "no"}}, status=self.status)
        return web.json_response({"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]})


@pytest.fixture
async def models() -> AsyncIterator[tuple[Models, HttpUpstream]]:
    m = Models()
    app = web.Application()
    app.router.add_get("/v1/models", m.handle)
    async with serving(app) as url:
        upstream = HttpUpstream(UpstreamSettings(name="u", url=f"{url}/v1"))
        yield m, upstream
        await upstream.close()


async def test_a_cold_burst_asks_once(models: tuple[Models, HttpUpstream]) -> None:
    m, upstream = models
    burst = [asyncio.create_task(upstream.serves("m1")) for _ in range(20)]
    await m.asked.wait()  # the first request reached the upstream; the others wait for it
    m.release.set()
    assert all(await asyncio.gather(*burst))
    assert await upstream.serves("m3") is False
    assert m.hits == 1


async def test_an_upstream_without_models_is_not_asked_before_every_request(
    models: tuple[Models, HttpUpstream],
) -> None:
    m, upstream = models
    m.status = 404
    m.release.set()
    for _ in range(5):
        assert await upstream.serves("anything")  # cannot say: forwarded, the upstream decides
    assert m.hits == 1
