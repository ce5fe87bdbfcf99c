"""Every client mistake and upstream failure gets an OpenAI-shaped error with the right status."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests import procs
from tests.sse_client import post_stream

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


async def _post_raw(
    url: str, data: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        return r.status, dict(r.headers), orjson.loads(await r.read())


def _assert_error(body: Any, openai_schemas: Any, code: str | None = None) -> None:
    openai_schemas.validate("ErrorResponse", body)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    if code is not None:
        assert body["error"]["code"] == code
    assert "Traceback" not in body["error"]["message"]


@pytest.mark.parametrize(
    ("data", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_json", None),
        (b'{"model": "sim-model"}', 400, "invalid_request", None),
        (b'{"model": "sim-model", "messages": []}', 400, "invalid_request", "messages"),
        (
            b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}',
            400,
            "invalid_request",
            "model",
        ),
        (
            b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}',
            400,
            "invalid_request",
            "messages[0].role",
        ),
        (
            b'{"model": "sim-model", "messages": [{"role": "user", "content": "x"}], '
            b'"temperature": 9}',
            400,
            "invalid_request",
            "temperature",
        ),
        (  # a content part is checked for its `type` only, as OpenAI requires it
            b'{"model": "sim-model", "messages": [{"role": "user", "content": '
            b'[{"type": "text", "text": "x"}, {"text": "y"}]}]}',
            400,
            "invalid_request",
            "messages[0].content[1]",
        ),
        (
            b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "model_not_found",
            "model",
        ),
    ],
)
async def test_client_mistakes_get_4xx_openai_errors(
    gateway: procs.Service,
    openai_schemas: Any,
    data: bytes,
    status: int,
    code: str,
    param: str | None,
) -> None:
    got, _, body = await _post_raw(
        gateway.url + "/v1/chat/completions", data, {"content-type": "application/json"}
    )
    assert got == status
    _assert_error(body, openai_schemas, code)
    if param is not None:
        assert body["error"]["param"] == param


async def test_unknown_route_and_method_are_openai_errors(
    gateway: procs.Service, openai_schemas: Any
) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(gateway.url + "/v1/nope") as r:
            assert r.status == 404
            _assert_error(await r.json(), openai_schemas)
        async with s.get(gateway.url + "/v1/chat/completions") as r:
            assert r.status == 405
            _assert_error(await r.json(), openai_schemas)


@pytest.fixture(scope="module")
def small_body_gateway(sim: procs.Service, tmp_path_factory: pytest.TempPathFactory) -> Any:
    cfg = tmp_path_factory.mktemp("cfg") / "gw.yaml"
    cfg.write_text(f"""
server:
  max_body_bytes: 2048
upstreams:
  - name: sim
    url: {sim.url}/v1
    read_timeout_seconds: 0.5
""")
    with procs.gateway("--config", str(cfg)) as g:
        yield g


async def test_oversized_body_is_413(
    small_body_gateway: procs.Service, openai_schemas: Any
) -> None:
    big = orjson.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]})
    status, _, body = await _post_raw(small_body_gateway.url + "/v1/chat/completions", big)
    assert status == 413
    _assert_error(body, openai_schemas, "request_too_large")


async def test_oversized_chunked_body_is_413(small_body_gateway: procs.Service) -> None:
    async def gen():  # type: ignore[no-untyped-def]
        for _ in range(10):
            yield b"x" * 1000

    async with (
        aiohttp.ClientSession() as s,
        s.post(small_body_gateway.url + "/v1/chat/completions", data=gen()) as r,
    ):
        assert r.status == 413


async def test_upstream_timeout_is_504(
    small_body_gateway: procs.Service, openai_schemas: Any
) -> None:
    status, _, body = await _post_raw(
        small_body_gateway.url + "/v1/chat/completions",
        orjson.dumps({**CHAT, "messages": [{"role": "user", "content": "[[sim ttft_ms=3000]]"}]}),
    )
    assert status == 504
    _assert_error(body, openai_schemas, "upstream_timeout")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_upstream_down_is_502(openai_schemas: Any) -> None:
    with procs.gateway("--upstream", f"http://127.0.0.1:{_closed_port()}/v1") as g:
        for stream in (False, True):
            status, _, body = await _post_raw(
                g.url + "/v1/chat/completions", orjson.dumps({**CHAT, "stream": stream})
            )
            assert status == 502
            _assert_error(body, openai_schemas, "upstream_unavailable")


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_upstream_http_errors_pass_through(
    gateway: procs.Service, openai_schemas: Any, status: int
) -> None:
    got, headers, body = await _post_raw(
        gateway.url + "/v1/chat/completions",
        orjson.dumps(
            {**CHAT, "messages": [{"role": "user", "content": f"[[sim fault=status:{status}]]"}]}
        ),
    )
    assert got == status
    _assert_error(body, openai_schemas)
    if status == 429:
        assert int(headers["Retry-After"]) >= 1


@pytest.mark.parametrize("fault", ["reset:3", "truncate:3", "garbage"])
async def test_error_after_stream_started_is_an_sse_error_event(
    gateway: procs.Service, openai_schemas: Any, fault: str
) -> None:
    body = {
        **CHAT,
        "stream": True,
        "max_tokens": 20,
        "messages": [{"role": "user", "content": f"[[sim fault={fault}]]"}],
    }
    r = await post_stream(gateway.url + "/v1/chat/completions", body)
    assert r.status == 200
    assert len(r.errors) == 1, r.chunks
    err = r.errors[0]
    openai_schemas.validate("ErrorResponse", {"error": err})
    assert err["code"] in ("upstream_stream_truncated", "upstream_protocol_error")
    if fault != "garbage":
        assert len(r.text.split()) == 3  # what arrived before the fault was delivered
        assert "3 content deltas" in err["message"]  # and the client is told how much
    assert not r.done  # the error event is the last: no [DONE] after it


def test_config_errors_are_exact(tmp_path: Path) -> None:
    import subprocess
    import sys

    cfg = tmp_path / "bad.yaml"
    cfg.write_text("server:\n  port: eighty\n")
    out = subprocess.run(
        [sys.executable, "-m", "tokenpipe", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "Expected `int`, got `str` - at `$.server.port`" in out.stderr


async def test_trickled_body_is_cut_off_with_408(sim: procs.Service, tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"server:\n  read_timeout_seconds: 0.5\nupstreams:\n  - name: sim\n    url: {sim.url}/v1\n"
    )
    with procs.gateway("--config", str(cfg)) as g:
        sock = socket.create_connection(("127.0.0.1", g.port))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"mo'
        )
        sock.settimeout(10)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(4096)
            assert chunk, "closed without an answer"
            reply += chunk
        sock.close()
        assert reply.startswith(b"HTTP/1.1 408")
        # And the gateway still serves others.
        status, _, _ = await _post_raw(g.url + "/v1/chat/completions", orjson.dumps(CHAT))
        assert status == 200
