"""Reusing upstream keep-alive connections (upstream/h1.py, upstream/reuse.py) against raw
loopback servers: a close right after a complete answer loses no request (checked before
reuse, else sent once more on a fresh connection), and an answer nobody asked for closes its
connection instead of being taken for the next request's."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from tests import procs
from tests.test_upstream_h1 import _get_head, _read_head, pool_for, raw_server
from tokenpipe.upstream.errors import UpstreamDisconnected, UpstreamError

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
SECOND = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nXX"


def _sse_answer() -> bytes:
    chunk = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
    }
    body = b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


async def _answer_once_then_close(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """A keep-alive answer (no `connection: close`), then the close at once: a request that
    raced it is never read."""
    head = await _read_head(reader)
    writer.write(OK if head.startswith(b"GET") else _sse_answer())
    await writer.drain()
    writer.close()


async def test_a_close_right_after_a_keepalive_answer_loses_no_request() -> None:
    async with pool_for(_answer_once_then_close) as pool:

        async def fetch() -> bytes:
            resp = await pool.request(_get_head(), b"", 5.0)
            return await resp.read()

        got = await asyncio.gather(*(fetch() for _ in range(50)), return_exceptions=True)
    assert got == [b"ok"] * 50


async def test_a_request_the_upstream_closed_on_unread_is_sent_once_more_fresh() -> None:
    requests: list[int] = []  # the connection (its number) each request arrived on
    accepted = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        me = accepted
        await _read_head(reader)
        requests.append(me)
        writer.write(OK)
        await writer.drain()
        await _read_head(reader)  # the next request arrives as the upstream closes
        requests.append(me)
        writer.close()

    async with pool_for(handle) as pool:
        for _ in range(2):
            resp = await pool.request(_get_head(), b"", 5.0)
            assert await resp.read() == b"ok"
        assert pool.resent == 1
    assert requests == [1, 1, 2]  # the second request: on the reused one, then on a fresh one


async def test_a_request_is_sent_again_at_most_once() -> None:
    requests = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        while True:
            await _read_head(reader)
            requests += 1
            if requests > 1:  # every later request, on any connection, is closed on
                writer.close()
                return
            writer.write(OK)
            await writer.drain()

    async with pool_for(handle) as pool:
        resp = await pool.request(_get_head(), b"", 5.0)
        assert await resp.read() == b"ok"
        with pytest.raises(UpstreamDisconnected):
            await pool.request(_get_head(), b"", 5.0)
    assert requests == 3


async def test_no_resend_once_a_byte_of_the_answer_arrived() -> None:
    requests = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await _read_head(reader)
        requests += 1
        writer.write(OK)
        await writer.drain()
        await _read_head(reader)
        requests += 1
        writer.write(b"HTTP/1.1 200")  # the upstream began to answer: it saw the request
        await writer.drain()
        writer.close()

    async with pool_for(handle) as pool:
        resp = await pool.request(_get_head(), b"", 5.0)
        assert await resp.read() == b"ok"
        with pytest.raises(UpstreamError):
            await pool.request(_get_head(), b"", 5.0)
        assert pool.resent == 0
    assert requests == 2


@pytest.mark.parametrize("when", ["with-the-answer", "while-idle"])
async def test_an_answer_nobody_asked_for_closes_its_connection(when: str) -> None:
    go, sent = asyncio.Event(), asyncio.Event()
    per_conn: list[int] = []  # requests read, per connection

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = len(per_conn)
        per_conn.append(0)
        while True:
            try:
                await _read_head(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            per_conn[me] += 1
            first = me == 0 and per_conn[me] == 1
            writer.write(OK + SECOND if first and when == "with-the-answer" else OK)
            await writer.drain()
            if first and when == "while-idle":
                await go.wait()
                writer.write(SECOND)  # on loopback: in the client's socket when drain returns
                await writer.drain()
            if first:
                sent.set()

    async with pool_for(handle) as pool:
        resp = await pool.request(_get_head(), b"", 5.0)
        assert await resp.read() == b"ok"
        go.set()
        await asyncio.wait_for(sent.wait(), 5.0)

        async def fetch() -> bytes:
            resp = await pool.request(_get_head(), b"", 5.0)
            return await asyncio.wait_for(resp.read(), 5.0)

        # Later requests neither hang nor read the stray answer; it never carries another.
        assert await asyncio.gather(*(fetch() for _ in range(3))) == [b"ok"] * 3
    assert per_conn[0] == 1


async def test_a_close_after_each_answer_fails_no_stream_through_the_gateway() -> None:
    async with raw_server(_answer_once_then_close) as url:
        g = await asyncio.to_thread(procs.gateway, "--upstream", str(url) + "/v1")
        try:
            body = orjson.dumps(
                {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            )
            async with aiohttp.ClientSession() as http:

                async def stream(n: int) -> list[tuple[int, bool]]:
                    seen = []
                    for _ in range(n):
                        async with http.post(g.url + "/v1/chat/completions", data=body) as r:
                            text = await r.read()
                            seen.append((r.status, text.endswith(b"data: [DONE]\n\n")))
                    return seen

                results = await asyncio.gather(*(stream(5) for _ in range(20)))
        finally:
            await asyncio.to_thread(g.stop)
    flat = [x for r in results for x in r]
    assert flat == [(200, True)] * 100, g.output()[-3000:]
