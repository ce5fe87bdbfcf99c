"""Every example client in examples/ runs against a real gateway and gets the whole answer;
the browser page is opened in headless Chromium and what it renders equals what it was sent.

The page is served by a small static server on its own origin (as a web app would be), and
the gateway is configured with `server.cors_origins` for that origin: this also proves the
opt-in CORS works from a real browser, preflight included (the page sends a custom header).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests import procs
from tests.server_timing import timing_comment
from tokenpipe import sse

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def page_origin() -> str:
    return f"http://127.0.0.1:{_free_port()}"


@pytest.fixture(scope="module")
def example_gateway(
    sim: procs.Service, page_origin: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[procs.Service, int]]:
    grpc_port = _free_port()
    cfg = tmp_path_factory.mktemp("examples") / "gw.yaml"
    cfg.write_text(
        f"server:\n  grpc_port: {grpc_port}\n  cors_origins: ['{page_origin}']\n"
        f"upstreams:\n  - name: sim\n    url: {sim.url}/v1\n"
    )
    with procs.Service("serve", "--port", "0", "--config", str(cfg), name="gateway") as g:
        yield g, grpc_port


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env={**os.environ, **env}, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_openai_sdk_streaming_example_prints_the_whole_answer(
    example_gateway: tuple[procs.Service, int],
) -> None:
    g, _ = example_gateway
    out = _run(
        [sys.executable, str(EXAMPLES / "openai_stream.py"), "Say hello"],
        {"TOKENPIPE_URL": g.url + "/v1", "TOKENPIPE_MAX_TOKENS": "12"},
    )
    assert len(out.stdout.split()) == 12
    assert "12 completion tokens" in out.stderr  # usage arrived, as asked


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_example_streams_sse_to_done(example_gateway: tuple[procs.Service, int]) -> None:
    g, _ = example_gateway
    out = _run(
        ["bash", str(EXAMPLES / "curl.sh"), 'Say "hi"'],
        {"TOKENPIPE_URL": g.url + "/v1", "TOKENPIPE_MAX_TOKENS": "7", "TOKENPIPE_RATE": "500"},
    )
    events = sse.SSEDecoder().feed(out.stdout.encode())
    assert events[-1].data == sse.DONE
    # (and the gateway's Server-Timing comment just before [DONE]: SSE clients ignore it)
    chunks = [json.loads(e.data) for e in events[:-1] if not timing_comment(e)]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(text.split()) == 7


def test_grpc_example_streams_two_requests_on_one_stream(
    example_gateway: tuple[procs.Service, int],
) -> None:
    _, grpc_port = example_gateway
    out = _run(
        [
            sys.executable,
            str(EXAMPLES / "grpc_client.py"),
            "--target",
            f"127.0.0.1:{grpc_port}",
            "--max-tokens",
            "9",
            "one",
            "two",
        ],
        {},
    )
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert set(lines) == {"req-0", "req-1"}
    assert all(len(t.split()) == 9 for t in lines.values())


@pytest.fixture
async def page_server(page_origin: str) -> AsyncIterator[asyncio.Queue[dict[str, Any]]]:
    """Serves examples/browser/ on `page_origin` and collects what the page reports."""
    reports: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=8)  # one per page load

    async def report(request: web.Request) -> web.Response:
        reports.put_nowait(json.loads(await request.read()))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/report", report)
    app.router.add_static("/", EXAMPLES / "browser")
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", int(page_origin.rsplit(":", 1)[1]))
    await site.start()
    yield reports
    await runner.cleanup()


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed")
async def test_browser_page_renders_exactly_the_streamed_text_at_the_hinted_rate(
    example_gateway: tuple[procs.Service, int],
    page_server: asyncio.Queue[dict[str, Any]],
    page_origin: str,
) -> None:
    g, _ = example_gateway
    tokens, rate = 40, 40  # tokens, tokens per second: at least ~1 s of pacing
    url = (
        f"{page_origin}/index.html?auto=1&report=/report&gateway={g.url}"
        f"&rate={rate}&max_tokens={tokens}&prompt=Tell+me+a+story"
    )
    # Chromium's helper processes may still be writing the throw-away profile as it goes.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        browser = await asyncio.create_subprocess_exec(
            CHROMIUM,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            url,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopped with its helpers
        )
        try:
            async with asyncio.timeout(60):
                result = await page_server.get()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(browser.pid, signal.SIGKILL)
            await browser.wait()
    assert result["error"] is None, result
    assert result["done"] is True
    assert result["rendered"] == result["streamed"]
    assert len(result["streamed"].split()) == tokens
    assert result["requestId"]  # exposed to the page through CORS
    # Paced to the hint: the sim alone would send 40 tokens in ~50 ms.
    assert result["ms"] >= 0.5 * tokens / rate * 1000, result["ms"]
