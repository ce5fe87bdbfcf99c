"""The client-facing edge: client mistakes are 4xx (never 500s or tracebacks), routes and
methods are named, keys never reach a log or an echo, auth schemes are case-insensitive, and
CORS lets a page use every documented header (issues 16.6, 16.13, 17.5, 17.6, 17.7)."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import socket
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests import procs

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
KEY = "sk-edge-" + "f00dfeed" * 4


@pytest.fixture(scope="module")
def edge(sim: procs.Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[procs.Service]:
    """A gateway with a key, CORS for one origin, a 64 KiB body limit and JSON access logs."""
    cfg = tmp_path_factory.mktemp("edge") / "gw.yaml"
    cfg.write_text(f"""
server:
  max_body_bytes: 65536
  cors_origins: ['http://app.example']
  access_log: true
auth:
  api_keys:
    - name: team-a
      sha256: {hashlib.sha256(KEY.encode()).hexdigest()}
upstreams:
  - name: sim
    url: {sim.url}/v1
""")
    with procs.gateway("--config", str(cfg), "--log-format", "json") as g:
        yield g


def _auth(scheme: str = "Bearer") -> dict[str, str]:
    return {"Authorization": f"{scheme} {KEY}", "Content-Type": "application/json"}


async def _post(
    url: str, data: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


def _error(body: bytes) -> dict[str, Any]:
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in err["message"]
    return dict(err)


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
async def test_bearer_scheme_is_case_insensitive(edge: procs.Service, scheme: str) -> None:
    status, _, body = await _post(
        edge.url + "/v1/chat/completions", orjson.dumps(CHAT), _auth(scheme)
    )
    assert status == 200, body


@pytest.mark.parametrize(
    ("encoding", "data"),
    [("gzip", b"this is not gzip at all"), ("deflate", b"\x00\x01not deflate")],
)
async def test_a_body_that_does_not_decompress_is_a_400(
    edge: procs.Service, encoding: str, data: bytes
) -> None:
    headers = {**_auth(), "Content-Encoding": encoding}
    status, _, body = await _post(edge.url + "/v1/chat/completions", data, headers)
    assert status == 400
    assert _error(body)["code"] == "invalid_body"


async def test_a_gzip_bomb_meets_the_body_limit(edge: procs.Service) -> None:
    bomb = gzip.compress(b" " * (64 << 20))  # 64 MiB of spaces in about 64 KiB
    assert len(bomb) < 65536
    headers = {**_auth(), "Content-Encoding": "gzip"}
    status, _, body = await _post(edge.url + "/v1/chat/completions", bomb, headers)
    assert status == 413
    assert _error(body)["code"] == "request_too_large"
    ok = gzip.compress(orjson.dumps(CHAT))  # and a good compressed body still works
    assert (await _post(edge.url + "/v1/chat/completions", ok, headers))[0] == 200
    assert zlib  # deflate is covered above


def _peak_rss(pid: int) -> int:
    """The process's peak resident set so far (Linux's VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def test_a_bomb_in_one_read_is_inflated_only_up_to_the_limit(edge: procs.Service) -> None:
    """64 MiB of spaces in under 64 KiB (this gateway's limit), arriving in a read or two: it
    is inflated step by step against the limit, never whole (the peak memory hardly moves)."""
    bomb = gzip.compress(b" " * (64 << 20))
    headers = {**_auth(), "Content-Encoding": "gzip"}
    before = _peak_rss(edge.pid)
    status, _, body = await _post(edge.url + "/v1/chat/completions", bomb, headers)
    assert status == 413 and _error(body)["code"] == "request_too_large"
    assert _peak_rss(edge.pid) - before < 16 << 20


@pytest.mark.parametrize("rate", ["inf", "nan", "-5", "1e300", "fast"])
async def test_a_bad_pace_header_is_a_400_before_the_stream(edge: procs.Service, rate: str) -> None:
    headers = {**_auth(), "x-tokenpipe-max-tokens-per-second": rate}
    status, resp_headers, body = await _post(
        edge.url + "/v1/chat/completions", orjson.dumps({**CHAT, "stream": True}), headers
    )
    assert status == 400
    assert resp_headers["Content-Type"].startswith("application/json")
    assert _error(body)["param"] == "x-tokenpipe-max-tokens-per-second"


async def test_unknown_route_names_the_served_ones_and_405_names_the_method(
    edge: procs.Service,
) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(edge.url + "/v1/assistants", json=CHAT, headers=_auth()) as r:
            assert r.status == 404  # (a route not served: /v1/responses is, since issue 19)
            err = _error(await r.read())
            assert "POST /v1/chat/completions" in err["message"]
            assert "POST /v1/responses" in err["message"]
            assert "GET /v1/models" in err["message"]
        async with s.get(edge.url + "/v1/chat/completions", headers=_auth()) as r:
            assert r.status == 405
            assert r.headers["Allow"] == "POST"
            assert "use POST" in _error(await r.read())["message"]


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def _log_lines(svc: procs.Service) -> list[dict[str, Any]]:
    out = []
    for line in svc.output().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_parser_rejections_are_json_400s_that_echo_nothing_and_log_a_bounded_few(
    edge: procs.Service,
) -> None:
    before = len(edge.output().splitlines())
    bad = [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header sk-secretsecret: 1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n",
        b"GET /\x01\x02 HTTP/9.9 sk-secretsecret\r\n\r\n",
    ] * 20
    for data in bad:
        answer = _raw(edge.port, data)
        head, _, body = answer.partition(b"\r\n\r\n")
        # 431 for the header over 16 KiB (RFC 6585), 400 for the others.
        assert head.split(b" ")[1] in (b"400", b"431"), answer[:200]
        assert b"application/json" in head
        assert _error(body)["code"] == "invalid_http_request"
        assert b"sk-secret" not in answer and b"aaaa" not in answer
    # The gateway still serves, and logged a bounded few lines, none of them a traceback.
    assert b"200" in _raw(
        edge.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(
        '"healthz"' in line or "/healthz" in line for line in edge.output().splitlines()[before:]
    ):
        time.sleep(0.05)  # waiting for the child's output pipe, not for the server
    new = edge.output().splitlines()[before:]
    rejected = [line for line in new if "rejected an unparsable HTTP request" in line]
    assert 1 <= len(rejected) <= 20  # 60 bad requests, at most 5 lines a second
    assert not any("Traceback" in line for line in new)


async def test_keys_never_reach_json_logs_or_the_echoed_request_id(edge: procs.Service) -> None:
    secret = "sk-live-" + "0123456789abcdef" * 2
    async with aiohttp.ClientSession() as s:
        async with s.get(edge.url + f"/v1/chat/completions/Bearer {secret}") as r:
            assert r.status == 404
            assert secret not in (await r.text())
        headers = {**_auth(), "x-request-id": secret}
        async with s.post(edge.url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
            assert r.status == 200
            assert r.headers["x-request-id"] != secret
            assert secret not in r.headers["x-request-id"]
        long_id = "a" * 129
        async with s.post(
            edge.url + "/v1/chat/completions",
            json=CHAT,
            headers={**_auth(), "x-request-id": long_id},
        ) as r:
            assert r.headers["x-request-id"] != long_id
        ok_id = "client-req-42"
        async with s.post(
            edge.url + "/v1/chat/completions", json=CHAT, headers={**_auth(), "x-request-id": ok_id}
        ) as r:
            assert r.headers["x-request-id"] == ok_id
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and ok_id not in edge.output():
        await asyncio.sleep(0.05)  # waiting for the child's output pipe, not for the server
    lines = _log_lines(edge)
    assert any(line.get("path", "").startswith("/v1/chat/completions/") for line in lines)
    assert secret not in edge.output()


async def test_cors_allows_and_exposes_every_documented_header(edge: procs.Service) -> None:
    url = edge.url + "/v1/chat/completions"
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    async with aiohttp.ClientSession() as s:
        async with s.options(url, headers=pre) as r:
            assert r.status == 204
            allowed = r.headers["Access-Control-Allow-Headers"]
        for name in ("x-tokenpipe-context-policy", "x-tokenpipe-deadline-seconds"):
            assert name in allowed
        headers = {**_auth(), "Origin": "http://app.example"}
        async with s.post(url, json=CHAT, headers=headers) as r:
            exposed = r.headers["Access-Control-Expose-Headers"]
        for name in ("x-tokenpipe-max-tokens", "x-tokenpipe-context"):
            assert name in [h.strip() for h in exposed.split(",")]


async def test_with_cors_off_a_preflight_gets_405_as_security_md_says(
    gateway: procs.Service,
) -> None:
    text = (Path(__file__).parent.parent / "SECURITY.md").read_text()
    assert "405" in text
    pre = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    url = gateway.url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as s, s.options(url, headers=pre) as r:
        assert r.status == 405
        assert "Access-Control-Allow-Origin" not in r.headers
