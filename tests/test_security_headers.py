"""What crosses the gateway: only the configuration chooses the upstream and its headers; no
client header (hop-by-hop, smuggling-prone, credentials, sim controls) is forwarded, and no
upstream header but the rate-limit ones comes back. CORS is off unless configured."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests import procs
from tests.local_app import serving
from tests.sse_client import post_stream

UPSTREAM_KEY = "sk-upstream-configured-0123456789"
CLIENT_KEY = "sk-client-presented-9876543210"
# What an aiohttp client sends on its own, plus what upstream/http.py sets from the config.
ALLOWED_UPSTREAM_HEADERS = {
    "host",
    "content-type",
    "content-length",
    "accept",
    "accept-encoding",
    "authorization",
    "x-request-id",
}
HOSTILE = {
    "Connection": "keep-alive, X-Smuggle",
    "X-Smuggle": "1",
    "Keep-Alive": "timeout=999",
    "Proxy-Connection": "keep-alive",
    "Proxy-Authorization": "Basic Zm9vOmJhcg==",
    "TE": "trailers",
    "Trailer": "X-Evil",
    "Authorization": f"Bearer {CLIENT_KEY}",
    "X-Api-Key": CLIENT_KEY,
    "Api-Key": CLIENT_KEY,
    "Cookie": "session=abc",
    "X-Forwarded-For": "10.0.0.1",
    "X-Forwarded-Host": "evil.example",
    "Forwarded": "for=10.0.0.1;host=evil.example",
    "X-Upstream": "http://evil.example/v1",
    "X-Tokenpipe-Upstream": "http://evil.example/v1",
    "OpenAI-Organization": "org-evil",
    "X-Sim-Fault": "status:500",
}


class Recorder:
    """A real OpenAI-shaped upstream on a free port that records what reaches it."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append((request.path, dict(request.headers), body))
        leak = {
            "Set-Cookie": "upstream=secret",
            "X-Upstream-Internal": "node-7",
            "x-ratelimit-remaining-requests": "99",
        }
        if orjson.loads(body).get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **leak})
            await resp.prepare(request)
            chunk = {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}],
            }
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        answer = {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        return web.json_response(answer, headers=leak)

    async def models(self, request: web.Request) -> web.Response:
        self.requests.append((request.path, dict(request.headers), b""))
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[Recorder, str]]:
    rec = Recorder()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", rec.chat)
    app.router.add_get("/v1/models", rec.models)
    async with serving(app) as url:
        yield rec, url


def _gateway_config(tmp_path: Path, upstream: str, extra: str = "") -> Path:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"{extra}upstreams:\n  - name: rec\n    url: {upstream}/v1\n"
        "    api_key_env: REC_KEY\n    models: ['m']\n"
    )
    return cfg


@pytest.mark.parametrize("stream", [False, True])
async def test_no_client_header_reaches_the_upstream_and_no_upstream_header_leaks_back(
    recorder: tuple[Recorder, str], tmp_path: Path, stream: bool
) -> None:
    rec, url = recorder
    cfg = _gateway_config(tmp_path, url)
    body = {
        "model": "m",
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
        # Body fields cannot pick the destination either (they are forwarded as data only).
        "base_url": "http://evil.example/v1",
        "api_base": "http://evil.example/v1",
    }
    with procs.gateway("--config", str(cfg), env={"REC_KEY": UPSTREAM_KEY}) as g:
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                g.url + "/v1/chat/completions",
                data=orjson.dumps(body),
                headers={**HOSTILE, "Content-Type": "application/json"},
            ) as r,
        ):
            assert r.status == 200
            await r.read()
            got = {k.lower() for k in r.headers}
    _, headers, _ = next(x for x in rec.requests if x[0] == "/v1/chat/completions")
    names = {k.lower() for k in headers}
    assert names <= ALLOWED_UPSTREAM_HEADERS, names - ALLOWED_UPSTREAM_HEADERS
    assert headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"  # the configured key only
    assert headers["Host"] == url.removeprefix("http://")
    assert headers.get("Connection", "keep-alive").lower() == "keep-alive"
    # Upstream's own headers stay upstream; its rate-limit headers come back on errors only
    # (a 200 carries the gateway's view).
    assert "set-cookie" not in got
    assert "x-upstream-internal" not in got


async def test_smuggling_framing_is_refused_before_any_upstream_call(
    recorder: tuple[Recorder, str], tmp_path: Path
) -> None:
    rec, url = recorder
    cfg = _gateway_config(tmp_path, url)
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    attacks = [
        # Content-Length and Transfer-Encoding together (CL.TE / TE.CL request smuggling).
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(body) + body,
        # Two different Content-Lengths.
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body,
        # An obfuscated Transfer-Encoding.
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n"
        + body,
    ]
    with procs.gateway("--config", str(cfg), env={"REC_KEY": UPSTREAM_KEY}) as g:
        for raw in attacks:
            reader, writer = await asyncio.open_connection("127.0.0.1", g.port)
            writer.write(raw)
            async with asyncio.timeout(10):
                reply = await reader.read(4096)
            writer.close()
            assert reply[:12] in (b"HTTP/1.1 400", b"HTTP/1.0 400"), reply[:100]
    assert not [x for x in rec.requests if x[0] == "/v1/chat/completions"]


async def test_cors_is_off_by_default(gateway: procs.Service) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.options(
            gateway.url + "/v1/chat/completions",
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        ) as r:
            assert "Access-Control-Allow-Origin" not in r.headers
            assert r.status >= 400
        async with s.get(gateway.url + "/healthz", headers={"Origin": "http://evil.example"}) as r:
            assert "Access-Control-Allow-Origin" not in r.headers


async def test_cors_allows_only_the_configured_origins_streams_included(
    sim: procs.Service, tmp_path: Path
) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "server:\n  cors_origins: ['http://app.example']\n"
        f"upstreams:\n  - name: sim\n    url: {sim.url}/v1\n"
    )
    pre = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization",
    }
    with procs.gateway("--config", str(cfg)) as g:
        async with aiohttp.ClientSession() as s:
            url = g.url + "/v1/chat/completions"
            async with s.options(url, headers={"Origin": "http://app.example", **pre}) as r:
                assert r.status == 204
                assert r.headers["Access-Control-Allow-Origin"] == "http://app.example"
                assert "authorization" in r.headers["Access-Control-Allow-Headers"]
            # The Anthropic SDK in a browser asks for its own headers, by family.
            sdk = {
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "x-api-key, anthropic-version, "
                "anthropic-dangerous-direct-browser-access, x-stainless-os, x-evil",
            }
            messages = g.url + "/v1/messages"
            async with s.options(messages, headers={"Origin": "http://app.example", **sdk}) as r:
                assert r.status == 204
                allowed = {h.strip() for h in r.headers["Access-Control-Allow-Headers"].split(",")}
                assert {"x-api-key", "anthropic-version", "x-stainless-os"} <= allowed
                assert "anthropic-dangerous-direct-browser-access" in allowed
                assert "x-evil" not in allowed
            async with s.options(url, headers={"Origin": "http://evil.example", **pre}) as r:
                assert r.status == 403
                assert "Access-Control-Allow-Origin" not in r.headers
        body: dict[str, Any] = {
            "model": "sim-model",
            "stream": True,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}],
        }
        ok = await post_stream(url, body, headers={"Origin": "http://app.example"})
        assert ok.done and ok.headers["Access-Control-Allow-Origin"] == "http://app.example"
        assert "x-request-id" in ok.headers["Access-Control-Expose-Headers"]
        # The page (and its devtools) may read the phases: exposed, and timing allowed.
        assert "server-timing" in ok.headers["Access-Control-Expose-Headers"]
        assert ok.headers["Timing-Allow-Origin"] == "http://app.example"
        assert "Server-Timing" in ok.headers
        other = await post_stream(url, body, headers={"Origin": "http://evil.example"})
        assert "Access-Control-Allow-Origin" not in other.headers
        assert "Timing-Allow-Origin" not in other.headers
