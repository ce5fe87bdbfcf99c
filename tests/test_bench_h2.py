"""The h2 client and the doctor's shared-connection probe over a real HTTP/2 connection.

tokenpipe's own servers speak HTTP/1.1 (aiohttp), so the HTTP/2 server here is hypercorn
(h2c, prior knowledge) serving a minimal OpenAI-style stream with a timing and a stall given
by request headers. `app` below is that server's ASGI application.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenpipe.bench import ChatRequest, run_load
from tokenpipe.doctor import Thresholds
from tokenpipe.doctor.hol import find_shared_stalls, probe

pytest.importorskip("hypercorn")
ROOT = Path(__file__).parent.parent


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    obj = {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "h2",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Streams `max_tokens` one-token chunks `x-itl-ms` apart after `x-ttft-ms`, pausing
    `x-stall-ms` after token `x-stall-after`."""
    if scope["type"] != "http":
        return
    headers = {k.decode(): v.decode() for k, v in scope["headers"]}
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    n = int(json.loads(body).get("max_tokens") or 16)
    ttft, itl = float(headers.get("x-ttft-ms", "20")), float(headers.get("x-itl-ms", "5"))
    stall_after, stall = (
        int(headers.get("x-stall-after", "-1")),
        float(headers.get("x-stall-ms", "0")),
    )
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    await send(
        {
            "type": "http.response.body",
            "body": _chunk({"role": "assistant", "content": ""}),
            "more_body": True,
        }
    )
    loop = asyncio.get_running_loop()
    due = loop.time() + ttft / 1000
    for i in range(n):
        if i == stall_after:
            due += stall / 1000
        await asyncio.sleep(max(0.0, due - loop.time()))
        await send(
            {"type": "http.response.body", "body": _chunk({"content": f" w{i}"}), "more_body": True}
        )
        due += itl / 1000
    tail = (
        _chunk({}, "length")
        + b"data: "
        + json.dumps(
            {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "h2",
                "choices": [],
                "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3},
            }
        ).encode()
        + b"\n\ndata: [DONE]\n\n"
    )
    await send({"type": "http.response.body", "body": tail, "more_body": False})


@pytest.fixture(scope="module")
def h2_server() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hypercorn",
            "--bind",
            f"127.0.0.1:{port}",
            "tests.test_bench_h2:app",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:  # poll until it accepts connections
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "hypercorn died"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_h2_client_speaks_http2_with_prior_knowledge_and_measures_itl(h2_server):
    r = await run_load(
        h2_server,
        "h2",
        concurrency=4,
        requests=8,
        max_tokens=20,
        protocols=("h2",),
        h2c=True,
        headers={"x-itl-ms": "10"},
        warmup=1,
    )
    assert {rec.http_version for rec in r.records} == {"HTTP/2"}
    assert r.notes == []  # no fallback to report
    s = r.summary().to_json()
    assert s["requests_ok"] == 8
    # Accuracy is proven against the sim; hypercorn's pure-Python HTTP/2 adds its own
    # per-frame delay on a busy machine, so this only checks the figures are the stream's.
    assert s["itl_token_ms"]["p50"] == pytest.approx(10, rel=0.2)
    assert s["output_tokens"] == 160


async def test_stall_on_every_stream_of_one_http2_connection_is_hol_blocking(h2_server):
    def req(stall: bool) -> ChatRequest:
        h = {"x-stall-after": "10", "x-stall-ms": "400"} if stall else {}
        return ChatRequest("h2", [{"role": "user", "content": "hi"}], 30, headers=h)

    p = await probe(h2_server, [req(True) for _ in range(4)], h2c=True)
    assert p.shared_connection and p.transport == "one HTTP/2 connection"
    [f] = find_shared_stalls(p, Thresholds())
    assert "4 of 4" in f.evidence and "share one connection" in f.evidence
    p = await probe(h2_server, [req(i == 0) for i in range(4)], h2c=True)
    assert p.shared_connection
    assert find_shared_stalls(p, Thresholds()) == []
