"""Slowloris: clients that trickle their headers or body are cut off at the read deadline
(`server.read_timeout_seconds`), and a normal client is served the whole time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests import procs
from tests.sse_client import post_stream

DEADLINE = 1.0  # server.read_timeout_seconds in this test (seconds)
#: The cut may come this much after the deadline (event-loop timer granularity, load).
SLACK = 3.0
SLOW_CLIENTS = 50
CHAT = {
    "model": "sim-model",
    "stream": True,
    "max_tokens": 30,
    "messages": [{"role": "user", "content": "[[sim itl_ms=100]] hi"}],
}


@pytest.fixture(scope="module")
def slow_gateway(
    sim: procs.Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[procs.Service]:
    cfg: Path = tmp_path_factory.mktemp("slowloris") / "gw.yaml"
    cfg.write_text(
        f"server:\n  read_timeout_seconds: {DEADLINE}\n  keepalive_seconds: {DEADLINE}\n"
        f"upstreams:\n  - name: sim\n    url: {sim.url}/v1\n"
    )
    with procs.gateway("--config", str(cfg)) as g:
        yield g


async def _trickle(port: int, head: bytes, drip: bytes) -> tuple[float, bytes]:
    """Sends `head`, then one byte of `drip` every 100 ms until the server answers or closes
    the connection. Returns (seconds until then, what the server sent)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(head)
    received = b""
    try:
        for i in range(int((DEADLINE + SLACK) * 10) + 20):
            writer.write(drip[i % len(drip) : i % len(drip) + 1])
            await writer.drain()
            try:
                chunk = await asyncio.wait_for(reader.read(4096), 0.1)  # the trickle's pace
            except TimeoutError:
                continue
            received += chunk
            if not chunk or b"\r\n\r\n" in received:
                break  # closed, or answered (408)
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        writer.close()
    return time.monotonic() - started, received


async def _cut_off_while_a_neighbour_streams(
    g: procs.Service, head: bytes, drip: bytes
) -> list[bytes]:
    neighbour = asyncio.create_task(post_stream(g.url + "/v1/chat/completions", CHAT))
    results = await asyncio.gather(*(_trickle(g.port, head, drip) for _ in range(SLOW_CLIENTS)))
    for took, _ in results:
        assert took < DEADLINE + SLACK, f"a trickling client held on for {took:.1f} s"
    r = await neighbour
    assert r.done and not r.errors and len(r.text.split()) == 30
    return [received for _, received in results]


async def test_trickled_headers_are_cut_off_and_others_are_served(
    slow_gateway: procs.Service,
) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    await _cut_off_while_a_neighbour_streams(slow_gateway, head, b"X-Slow: aaaaaaaaaa\r\n")


async def test_trickled_body_is_cut_off_with_408_and_others_are_served(
    slow_gateway: procs.Service,
) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    )
    replies = await _cut_off_while_a_neighbour_streams(
        slow_gateway, head, b'{"model": "sim-model", '
    )
    assert all(r.startswith(b"HTTP/1.1 408") for r in replies), {r[:20] for r in replies}


async def test_idle_connection_without_a_request_is_closed(slow_gateway: procs.Service) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", slow_gateway.port)
    started = time.monotonic()
    async with asyncio.timeout(DEADLINE + SLACK):
        assert await reader.read() == b""
    writer.close()
    assert time.monotonic() - started >= DEADLINE * 0.9
    async with aiohttp.ClientSession() as s, s.get(slow_gateway.url + "/healthz") as r:
        assert r.status == 200


async def test_a_kept_alive_connection_closes_a_deadline_after_its_last_answer(
    slow_gateway: procs.Service,
) -> None:
    """The idle keep-alive (server.keepalive_seconds, here as long as the read deadline)
    counts from the last answer, not from the connection's start: a client idle for most
    of a deadline, then answered, has a whole keep-alive again."""
    reader, writer = await asyncio.open_connection("127.0.0.1", slow_gateway.port)
    await asyncio.sleep(DEADLINE * 0.6)  # the client idles (the scenario, not a wait)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    async with asyncio.timeout(DEADLINE + SLACK):
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        answered = time.monotonic()
        assert await reader.read() == b""  # closed by the server
    writer.close()
    assert time.monotonic() - answered >= DEADLINE * 0.9
