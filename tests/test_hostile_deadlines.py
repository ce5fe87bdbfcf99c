"""Hostile upstreams and clients (issue 16, items 2, 11, 12, 15), on real sockets: the gateway
and the sim as processes, a hostile upstream of our own on loopback."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from tests import procs
from tests.polling import metrics as _metrics
from tests.polling import until as _until
from tests.sse_client import post_stream

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}


def _config(tmp: Path, url: str, extra: str = "") -> str:
    cfg = tmp / "gw.yaml"
    cfg.write_text(f"upstreams:\n  - name: up\n    url: {url}/v1\n{extra}")
    return str(cfg)


# -- item 2: malformed usage must not leak permits -------------------------------------------

BAD_USAGES: list[Any] = [
    {"prompt_tokens": "3", "completion_tokens": "x", "total_tokens": "y"},
    {"prompt_tokens": -5, "completion_tokens": -1e18, "total_tokens": -1},
    {"prompt_tokens": True, "completion_tokens": 1e400, "total_tokens": 10**30},
    "not an object",
]


@asynccontextmanager
async def _hostile_usage_upstream() -> AsyncIterator[str]:
    """Answers every completion (streamed or not) with a malformed `usage`, in turn."""
    n = 0

    async def chat(request: web.Request) -> web.StreamResponse:
        nonlocal n
        req = await request.json()
        usage = BAD_USAGES[n % len(BAD_USAGES)]
        n += 1
        head = {"id": "x", "object": "chat.completion", "created": 0, "model": "sim-model"}
        if not req.get("stream"):
            msg = {"index": 0, "message": {"role": "assistant", "content": "ok"}}
            body = {**head, "choices": [{**msg, "finish_reason": "stop"}], "usage": usage}
            return web.Response(body=orjson.dumps(body), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        delta = {"index": 0, "delta": {"content": "ok"}, "finish_reason": None}
        end = {"index": 0, "delta": {}, "finish_reason": "stop"}
        for ev in ({**head, "choices": [delta]}, {**head, "choices": [end]}):
            await resp.write(b"data: " + orjson.dumps(ev) + b"\n\n")
        await resp.write(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}))
        await resp.write(b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "sim-model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_malformed_usage_never_leaks_a_permit(tmp_path: Path) -> None:
    """Two permits; ten answers with malformed usage (streamed and not): every request and
    every good request after them succeeds (on main the third waits, then 429s)."""
    limits = """limits:
  adaptive_concurrency: false
  max_concurrency: 2
  queue_deadline_seconds: 1
keys:
  default: {max_concurrency: 2}
"""
    async with _hostile_usage_upstream() as url:
        with procs.gateway("--config", _config(tmp_path, url, limits)) as gw:
            async with aiohttp.ClientSession() as s:
                for i in range(10):
                    body = {**CHAT, "stream": i % 2 == 1}
                    async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                        text = await r.text()
                        assert r.status == 200, (i, r.status, text)
                        assert "ok" in text
            m = await _metrics(gw)
    inflight = [v for k, v in m.items() if k.startswith("tokenpipe_inflight_requests")]
    assert inflight and all(v == 0 for v in inflight), inflight


# -- item 11: the client's own deadline is no evidence against the upstream -------------------


async def test_client_deadlines_leave_breaker_and_concurrency_limit_alone(tmp_path: Path) -> None:
    extra = """limits:
  initial_concurrency: 16
tail:
  breaker: {failures: 3}
"""
    with (
        procs.sim("--ttft-ms", "50", "--itl-ms", "1") as sim,
        procs.gateway("--config", _config(tmp_path, sim.url, extra)) as gw,
    ):
        limit_key = 'tokenpipe_concurrency_limit{upstream="up"}'
        sem = asyncio.Semaphore(30)
        statuses: list[int] = []

        async def one(s: aiohttp.ClientSession, i: int, deadline: str) -> None:
            async with sem:
                body = {**CHAT, "stream": i % 2 == 0, "max_tokens": 5}
                h = {"x-tokenpipe-deadline-seconds": deadline}
                async with s.post(gw.url + "/v1/chat/completions", json=body, headers=h) as r:
                    await r.read()
                    statuses.append(r.status)

        async with aiohttp.ClientSession() as s:
            # An answer from loopback opens the cold limit (control/limiter.py): from 16 to
            # the maximum, where a drop would show.
            await one(s, 1, "30")
            before = await _metrics(gw)
            assert before[limit_key] == 1024
            # The burst: deadlines that pass before anything is sent.
            await asyncio.gather(*(one(s, i, "1e-9") for i in range(351)))
            after = await _metrics(gw)
            assert after[limit_key] == 1024, after[limit_key]
            assert after['tokenpipe_upstream_state{upstream="up"}'] == 0  # closed
            # Deadlines that pass while waiting for the first token (0.02 s < the sim's
            # 50 ms TTFT): the upstream answered 200, then the client's bound struck.
            await asyncio.gather(*(one(s, i, "0.02") for i in range(150)))
        after = await _metrics(gw)
    assert after[limit_key] == 1024, after[limit_key]
    assert after['tokenpipe_upstream_state{upstream="up"}'] == 0  # closed
    assert statuses.count(200) + statuses.count(504) == len(statuses), set(statuses)


# -- item 15: errors name the bound that was hit ---------------------------------------------


async def test_a_client_deadline_before_the_first_token_names_the_clients_deadline(
    tmp_path: Path,
) -> None:
    with (
        procs.sim("--ttft-ms", "3000", "--itl-ms", "1") as sim,
        procs.gateway("--config", _config(tmp_path, sim.url)) as gw,
    ):
        t0 = time.monotonic()
        r = await post_stream(
            gw.url + "/v1/chat/completions",
            {**CHAT, "stream": True},
            headers={"x-tokenpipe-deadline-seconds": "0.5"},
            timeout=10,
        )
        took = time.monotonic() - t0
    assert r.status == 200
    assert len(r.errors) == 1, r.chunks
    msg = r.errors[0]["message"]
    assert "client's deadline of 0.5 s" in msg, msg
    assert "10 s" not in msg, msg
    assert r.errors[0]["code"] == "upstream_timeout"
    assert took < 2.5, took


async def test_a_client_deadline_mid_stream_names_the_clients_deadline(tmp_path: Path) -> None:
    with (
        procs.sim("--ttft-ms", "5", "--itl-ms", "100") as sim,
        procs.gateway("--config", _config(tmp_path, sim.url)) as gw,
    ):
        r = await post_stream(
            gw.url + "/v1/chat/completions",
            {**CHAT, "stream": True, "max_tokens": 100},
            headers={"x-tokenpipe-deadline-seconds": "0.5"},
            timeout=10,
        )
    assert r.status == 200
    assert len(r.errors) == 1, r.chunks
    msg = r.errors[0]["message"]
    assert "client's deadline of 0.5 s" in msg and "mid-stream" in msg, msg
    assert r.text  # some content came before the cut


async def test_a_queue_timeout_says_how_long_it_waited_and_a_real_retry_after(
    tmp_path: Path,
) -> None:
    """One permit, held by a 3-s stream; three more wait 1.5 s and get 429. The wait that
    ended is named, and Retry-After is the expected wait (>= 2 s), not a flat 1 s."""
    extra = """limits:
  adaptive_concurrency: false
  max_concurrency: 1
  queue_deadline_seconds: 1.5
"""
    with (
        procs.sim("--ttft-ms", "5", "--itl-ms", "30") as sim,
        procs.gateway("--config", _config(tmp_path, sim.url, extra)) as gw,
    ):
        url = gw.url + "/v1/chat/completions"
        long = asyncio.create_task(
            post_stream(url, {**CHAT, "stream": True, "max_tokens": 100}, timeout=20)
        )

        async def holder() -> bool:
            m = await _metrics(gw)
            return any(k.startswith("tokenpipe_inflight_requests") and v for k, v in m.items())

        await _until(holder, 10, "the long stream to hold the permit")
        async with aiohttp.ClientSession() as s:

            async def waiter() -> tuple[int, str, dict[str, str]]:
                async with s.post(url, json={**CHAT, "max_tokens": 5}) as r:
                    return r.status, await r.text(), dict(r.headers)

            answers = await asyncio.gather(*(waiter() for _ in range(3)))
        await long
    for status, text, headers in answers:
        assert status == 429, (status, text)
        assert "1.5 s" in text, text
        assert int(headers["Retry-After"]) >= 2, headers
        retry = orjson.loads(text)["error"]["message"].rsplit("retry after ", 1)[1]
        assert retry.startswith(headers["Retry-After"] + " s"), (retry, headers)


# -- item 12: every disconnect reaches the upstream ------------------------------------------


async def _sim_active(sim: procs.Service) -> int:
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/stats?last=0") as r:
        return int((await r.json())["active"])


async def _client_that_leaves(port: int, rng: random.Random, started: list[int]) -> None:
    """A raw HTTP/1.1 client: sends a streamed request, reads a random part of the stream
    (or nothing: it may leave while the upstream's headers are on their way), then leaves,
    by FIN or by RST."""
    body = orjson.dumps({**CHAT, "stream": True, "max_tokens": 400})
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    await writer.drain()
    want = rng.choice([0, 0, 1, 1, 200, 2000, 6000])
    got = 0
    if want:
        started[0] += 1
    try:
        if not want:  # leaves within the first ~60 ms: before, with or after the headers
            await asyncio.sleep(rng.random() * 0.06)
        while got < want:
            chunk = await asyncio.wait_for(reader.read(4096), 10)
            if not chunk:
                break
            got += len(chunk)
    finally:
        sock = writer.get_extra_info("socket")
        if rng.random() < 0.5 and sock is not None:  # RST instead of FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()


async def test_every_client_disconnect_closes_its_upstream_stream(tmp_path: Path) -> None:
    """1,000 clients (TP_N_CLIENTS) leave at random points (before the headers, in the role
    chunk, mid-stream; by FIN or RST) of streams the sim would send for 8 s, hedged: within
    3 s of the last one leaving no upstream stream is open at the sim."""
    extra = """tail:
  hedging: {budget_ratio: 0.5, initial_delay_seconds: 0.01, min_delay_seconds: 0.01}
"""
    with (
        procs.sim("--ttft-ms", "30", "--itl-ms", "20") as sim,
        procs.gateway("--config", _config(tmp_path, sim.url, extra)) as gw,
    ):
        port = int(gw.url.rsplit(":", 1)[1])
        rng = random.Random(16)
        started = [0]
        sem = asyncio.Semaphore(100)

        async def one() -> None:
            async with sem:
                await _client_that_leaves(port, rng, started)

        await asyncio.gather(*(one() for _ in range(N_CLIENTS)))
        left_at = time.monotonic()
        try:
            await _until(lambda: _active_is_zero(sim), 3, "every upstream stream to close")
        except AssertionError:
            async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/stats?last=2000") as r:
                stats = await r.json()
            running = [x for x in stats["records"] if x["outcome"] == "running"]
            m = await _metrics(gw)
            inflight = {k: v for k, v in m.items() if "inflight" in k or "hedge" in k}
            raise AssertionError(
                f"the sim has {stats['active']} streams open ({len(running)} records not ended,"
                f" first: {running[:3]}); gateway: {inflight}"
            ) from None
        finally:
            took = time.monotonic() - left_at
        assert started[0] > 100
        assert took < 3, took


N_CLIENTS = int(__import__("os").environ.get("TP_N_CLIENTS", "1000"))


async def _active_is_zero(sim: procs.Service) -> bool:
    return await _sim_active(sim) == 0


@asynccontextmanager
async def _twin_upstream() -> AsyncIterator[tuple[str, list[int]]]:
    """Holds the first token of the first request until a second (the hedge) arrives, then
    sends both their first tokens at once, then streams on slowly for 10 s. `open[0]`:
    responses whose client is still reading."""
    second = asyncio.Event()
    n = 0
    open_ = [0]

    async def chat(request: web.Request) -> web.StreamResponse:
        nonlocal n
        await request.read()
        n += 1
        if n >= 2:
            second.set()
        head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "sim-model"}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        open_[0] += 1
        try:
            role = {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}
            await resp.write(b"data: " + orjson.dumps({**head, "choices": [role]}) + b"\n\n")
            await second.wait()
            for i in range(200):
                delta = {"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}
                await resp.write(b"data: " + orjson.dumps({**head, "choices": [delta]}) + b"\n\n")
                await asyncio.sleep(0.05)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            open_[0] -= 1
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", open_
    finally:
        await runner.cleanup()


async def test_a_hedge_answering_with_the_primary_is_closed_when_the_client_leaves(
    tmp_path: Path,
) -> None:
    """Primary and hedge bring their first token in the same loop step: the primary wins,
    and the hedge's response must be closed (before: it streamed on upstream, unread)."""
    extra = """tail:
  hedging: {budget_ratio: 1.0, initial_delay_seconds: 0.05, min_delay_seconds: 0.01}
"""
    async with _twin_upstream() as (url, open_):
        with procs.gateway("--config", _config(tmp_path, url, extra)) as gw:
            got: list[dict[str, Any]] = []

            async with (
                aiohttp.ClientSession() as s,
                s.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r,
            ):
                assert r.status == 200
                async for line in r.content:
                    if b'"content"' in line:
                        got.append(orjson.loads(line[5:]))
                        if len(got) >= 3:
                            break  # the client leaves mid-stream

            async def closed() -> bool:
                return open_[0] == 0

            await _until(closed, 2, "both upstream responses to close")
            m = await _metrics(gw)
    assert (
        m.get('tokenpipe_hedges_total{outcome="lost"}', 0)
        + m.get('tokenpipe_hedges_total{outcome="won"}', 0)
        >= 1
    ), {k: v for k, v in m.items() if "hedge" in k}
