"""An https upstream through the gateway (uvloop, the real client): the certificate is checked
against the system's trust store, which `SSL_CERT_FILE` extends, as for any OpenSSL client."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
import trustme
from aiohttp import web

from tests import procs
from tests.local_app import serving
from tests.sse_client import post_stream

WORDS = ["secure", " tokens", " arrive"]


async def _chat(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for word in WORDS:
        chunk = {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}],
        }
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@pytest.fixture
async def tls_upstream(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """An OpenAI-shaped upstream over TLS with a certificate from a throw-away CA; yields its
    base URL and the CA's certificate file."""
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    async with serving(app, server_ctx) as url:
        yield url, ca_file


def _config(tmp_path: Path, url: str) -> Path:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"upstreams:\n  - name: tls\n    url: {url}/v1\n    models: ['m']\n")
    return cfg


BODY = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_trusted_https_upstream_streams_through(
    tls_upstream: tuple[str, Path], tmp_path: Path
) -> None:
    url, ca_file = tls_upstream
    env = {"SSL_CERT_FILE": str(ca_file)}
    with procs.gateway("--config", str(_config(tmp_path, url)), env=env) as gw:
        result = await post_stream(gw.url + "/v1/chat/completions", BODY)
    assert result.status == 200 and result.done
    assert result.text == "".join(WORDS)


async def test_an_untrusted_certificate_is_refused(
    tls_upstream: tuple[str, Path], tmp_path: Path
) -> None:
    url, _ = tls_upstream
    with procs.gateway("--config", str(_config(tmp_path, url))) as gw:
        result = await post_stream(gw.url + "/v1/chat/completions", BODY)
    assert result.status == 502
    assert orjson.loads(result.body)["error"]["code"] == "upstream_unavailable"
