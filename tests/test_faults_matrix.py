"""The fault matrix with real processes: for each fault, what the client sees, and that a
neighbour on a healthy upstream (or the next request) is not affected.

Two sims behind one gateway: `a` (the one that fails) serves model `a-model`, `b` serves
`b-model`. docs/reliability.md has the table these tests back.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests import procs
from tests.redis_server import RedisServer
from tests.sse_client import StreamResult, post_stream

#: Bound on any wait in this module (seconds).
WAIT = 20.0


def _chat(model: str, tokens: int, directive: str = "", stream: bool = True) -> dict[str, Any]:
    return {
        "model": model,
        "stream": stream,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": f"{directive} hello"}],
    }


async def _until(cond: Callable[[], Awaitable[bool]], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)  # polling a condition with a deadline


async def _metric(g: procs.Service, prefix: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(g.url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(prefix) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _intact(r: StreamResult, tokens: int) -> None:
    assert r.status == 200 and r.done and not r.errors, (r.status, r.errors, r.body[:200])
    assert len(r.text.split()) == tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[procs.Service, procs.Service, procs.Service]]:
    """(sim a, sim b, gateway over both), fresh for each test: `a` gets broken."""
    with (
        procs.sim("--model", "a-model", "--strict-models", "--ttft-ms", "5", "--itl-ms", "2") as a,
        procs.sim("--model", "b-model", "--strict-models", "--ttft-ms", "5", "--itl-ms", "2") as b,
    ):
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(
            "upstreams:\n"
            f"  - {{name: a, url: '{a.url}/v1', models: [a-model], read_timeout_seconds: 1}}\n"
            f"  - {{name: b, url: '{b.url}/v1', models: [b-model]}}\n"
        )
        with procs.gateway("--config", str(cfg), "--drain-seconds", "20") as g:
            yield a, b, g


async def test_upstream_killed_mid_stream_cuts_that_stream_cleanly_and_spares_others(
    pair: tuple[procs.Service, procs.Service, procs.Service],
) -> None:
    a, _, g = pair
    url = g.url + "/v1/chat/completions"
    started = asyncio.Event()
    victim = asyncio.create_task(
        post_stream(
            url, _chat("a-model", 400, "[[sim itl_ms=20]]"), on_chunk=lambda c: started.set()
        )
    )
    neighbour = asyncio.create_task(post_stream(url, _chat("b-model", 200, "[[sim itl_ms=10]]")))
    async with asyncio.timeout(WAIT):
        await started.wait()
    a.proc.kill()  # SIGKILL: no FIN from a graceful close, the socket just dies with it
    r = await victim
    # One error event ends the stream: no [DONE] after it (a cut answer never looks whole).
    assert r.status == 200 and not r.done, "no [DONE] after an error event"
    assert len(r.errors) == 1
    assert "The answer is incomplete" in r.errors[0]["message"]
    _intact(await neighbour, 200)
    # Now `a` refuses connections: a clean 502 at once, and `b` still serves.
    refused = await post_stream(url, _chat("a-model", 5))
    # 502 upstream_unavailable, or 503 once the circuit breaker has opened for `a`.
    assert refused.status in (502, 503), refused.status
    assert orjson.loads(refused.body)["error"]["code"] in (
        "upstream_unavailable",
        "upstream_circuit_open",
    )
    _intact(await post_stream(url, _chat("b-model", 5)), 5)
    await _until(lambda: _zero_inflight(g), "no request left in flight")


async def _zero_inflight(g: procs.Service) -> bool:
    return await _metric(g, "tokenpipe_inflight_requests") == 0


@pytest.mark.parametrize("fault", ["garbage", "truncate:5", "reset:5"])
async def test_garbage_or_truncated_sse_ends_that_stream_with_an_error_event_only(
    pair: tuple[procs.Service, procs.Service, procs.Service], fault: str
) -> None:
    _, _, g = pair
    url = g.url + "/v1/chat/completions"
    bad, good = await asyncio.gather(
        post_stream(url, _chat("a-model", 50, f"[[sim fault={fault}]]")),
        post_stream(url, _chat("b-model", 50)),
    )
    assert bad.status == 200 and not bad.done and len(bad.errors) == 1, (bad.errors, bad.body[:200])
    _intact(good, 50)
    _intact(await post_stream(url, _chat("a-model", 5)), 5)  # the next request on `a` is fine


async def test_upstream_hanging_after_headers_is_cut_at_its_read_timeout(
    pair: tuple[procs.Service, procs.Service, procs.Service],
) -> None:
    _, _, g = pair
    url = g.url + "/v1/chat/completions"
    t0 = time.monotonic()
    hung, good = await asyncio.gather(
        post_stream(url, _chat("a-model", 5, "[[sim fault=hang-after-headers]]")),
        post_stream(url, _chat("b-model", 100, "[[sim itl_ms=10]]")),
    )
    took = time.monotonic() - t0
    # Cut by whichever deadline comes first (`a`'s read_timeout_seconds: 1, or the first-token
    # deadline of the tail-latency control). What arrives is OpenAI-shaped: a 5xx before the
    # first byte, or an SSE error event (the last: no [DONE]) once streaming has started.
    if hung.status == 200:
        assert not hung.done and len(hung.errors) == 1
        assert hung.errors[0]["code"] in ("upstream_timeout", "upstream_stream_truncated")
    else:
        assert hung.status in (502, 503, 504), hung.status
        assert "error" in orjson.loads(hung.body)
    assert took < 15, took
    _intact(good, 100)


async def test_sigterm_with_100_open_streams_finishes_every_one(
    sim: procs.Service, tmp_path: Path
) -> None:
    cfg = tmp_path / "gw.yaml"
    # All 100 in flight at once (the adaptive limit would start at 32 and queue the rest).
    cfg.write_text(
        f"limits:\n  initial_concurrency: 200\nupstreams:\n  - name: sim\n    url: {sim.url}/v1\n"
    )
    g = procs.gateway("--config", str(cfg), "--drain-seconds", "20")
    n, tokens = 100, 200
    try:
        url = g.url + "/v1/chat/completions"
        streams = [
            asyncio.create_task(
                post_stream(url, _chat("sim-model", tokens, "[[sim itl_ms=20]]"), timeout=60)
            )
            for _ in range(n)
        ]
        await _until(lambda: _inflight_at_least(g, n), f"{n} open streams", timeout=30)
        t0 = time.monotonic()
        g.signal(signal.SIGTERM)
        # New requests are told 503 `draining` (a load balancer sends them elsewhere; the port
        # keeps answering while streams are open, docs/config.md) while the open streams go on.
        await _until(lambda: _draining(g.url), "new requests told draining", timeout=10)
        assert not any(s.done() for s in streams)
        results = await asyncio.gather(*streams)
        drained = time.monotonic() - t0
        for r in results:
            _intact(r, tokens)  # none cut
        assert await asyncio.to_thread(g.wait, 25) == 0
        assert drained < 20
    finally:
        g.stop()


async def _draining(base: str) -> bool:
    async with (
        aiohttp.ClientSession() as s,
        s.post(base + "/v1/chat/completions", json=_chat("sim-model", 1)) as r,
    ):
        return r.status == 503 and (await r.json())["error"]["code"] == "draining"


async def _inflight_at_least(g: procs.Service, n: int) -> bool:
    return await _metric(g, "tokenpipe_inflight_requests") >= n


async def test_sigkill_and_restart_clients_get_errors_then_a_clean_gateway(
    sim: procs.Service,
) -> None:
    port = _free_port()
    args = ("--upstream", sim.url + "/v1", "--port", str(port), "--grpc-port", "0")
    g = procs.Service("serve", *args, name="gateway")
    url = g.url + "/v1/chat/completions"
    started = asyncio.Event()
    streams = [
        asyncio.create_task(
            post_stream(
                url, _chat("sim-model", 300, "[[sim itl_ms=20]]"), on_chunk=lambda c: started.set()
            )
        )
        for _ in range(10)
    ]
    async with asyncio.timeout(WAIT):
        await started.wait()
    g.proc.kill()
    outcomes = await asyncio.gather(*streams, return_exceptions=True)
    g.stop()
    for o in outcomes:
        # The connection dies under the client: its HTTP library raises (no partial answer
        # passes for a whole one: there is no [DONE]).
        assert isinstance(o, aiohttp.ClientError) or (isinstance(o, StreamResult) and not o.done), o
    with procs.Service("serve", *args, name="gateway") as g2:
        assert g2.port == port
        _intact(await post_stream(url, _chat("sim-model", 20)), 20)
        assert await _metric(g2, "tokenpipe_inflight_requests") == 0  # no stuck state


async def test_redis_killed_and_restarted_requests_keep_being_served(
    sim: procs.Service, tmp_path: Path
) -> None:
    with RedisServer() as redis:
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(
            f"limits:\n  backend: redis\n  redis: {{url: '{redis.url}', timeout_seconds: 0.1}}\n"
            f"upstreams:\n  - name: sim\n    url: {sim.url}/v1\n"
        )
        with procs.gateway("--config", str(cfg)) as g:
            url = g.url + "/v1/chat/completions"
            _intact(await post_stream(url, _chat("sim-model", 5)), 5)
            assert await _metric(g, "tokenpipe_limits_redis_fallback") == 0
            redis.kill()
            for _ in range(5):  # served on the local share meanwhile
                _intact(await post_stream(url, _chat("sim-model", 5)), 5)
            await _until(lambda: _fallback(g, 1), "fallback to the local share")
            redis.start()
            await _until(lambda: _fallback(g, 0), "back on the shared buckets")
            _intact(await post_stream(url, _chat("sim-model", 5)), 5)
        out = g.output()
        assert "redis unreachable" in out and "redis reachable again" in out


async def _fallback(g: procs.Service, value: float) -> bool:
    return await _metric(g, "tokenpipe_limits_redis_fallback") == value
