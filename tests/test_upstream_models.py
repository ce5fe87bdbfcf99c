"""An upstream's /v1/models is asked once per TTL: a cold burst shares one request, and an
upstream without the route is not asked again in front of every completion."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from tests.local_app import serving
from tests.traced import peak_bytes
from tokenpipe.context.windows import windows_of
from tokenpipe.settings import UpstreamSettings
from tokenpipe.upstream import model_list
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


def test_a_model_list_costs_the_fields_read_not_what_it_holds() -> None:
    """A /models answer is decoded for each entry's id and window fields only
    (upstream/model_list.py): 4 MiB of `[]`s beside them are skipped, not built (a whole
    parse peaked at ~30x the answer), and the list and the windows read as before."""
    junk = b"[" + b",".join([b"[]"] * ((4 << 20) // 3)) + b"]"
    entry = b'{"id":"a","max_model_len":4096,"meta":{"n_ctx_train":8192},"x":' + junk + b"}"
    body = b'{"object":"list","data":[' + entry + b',"not an entry",{"id":"b"}],"y":' + junk + b"}"
    data, peak = peak_bytes(lambda: model_list.read(body))
    assert peak < len(body), f"{peak / len(body):.1f}x the answer"
    upstream = HttpUpstream(UpstreamSettings(name="u", url="http://127.0.0.1:9/v1"))
    assert upstream._learn(data, 0.0) == {"a", "b"}
    assert windows_of(data) == {"a": 4096}
    # Another shape (an object as an id) is parsed whole up to 64 KiB, and is no list past it.
    odd = b'{"data":[{"id":{"x":1}},{"id":"c"}]}'
    assert upstream._learn(model_list.read(odd), 0.0) == {"c"}
    assert model_list.read(odd[:-2] + b',"pad":"' + b"p" * 70_000 + b'"}]}') is None
    with pytest.raises(ValueError):
        model_list.read(b"not json")
