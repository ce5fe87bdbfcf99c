"""The upstream client's failures are its own types (upstream/errors.py), on real loopback
sockets: a refused port, a connect that never completes, a close before or in the middle of
an answer, bytes that break HTTP/1.1 framing; and `HttpUpstream.post` turns each into the
gateway's error (502/504 and its code). The pace a client asks for reaches the upstream as
`post`'s argument, through the whole request path."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import aiohttp
import pytest
from yarl import URL

from tests.hostile_upstream import DONE, chat_chunk, sse_reply
from tests.test_upstream_h1 import _get_head, _read_head, answering, pool_for, raw_server
from tokenpipe import gateway
from tokenpipe.errors import GatewayError
from tokenpipe.settings import Settings, UpstreamSettings
from tokenpipe.upstream import errors, h1
from tokenpipe.upstream.http import PACE_HEADER, PROTOCOL_ERROR, HttpUpstream


async def _free_url() -> URL:
    """A loopback port nothing listens on (it was free a moment ago)."""

    async def ignore(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async with raw_server(ignore) as url:
        pass
    return url


@contextlib.contextmanager
def never_accepting() -> Iterator[URL]:
    """A port whose accept queue is full: a further connect gets no answer to its SYN (Linux
    drops it), so connecting hangs until the client's own bound."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers: list[socket.socket] = []
    try:
        for _ in range(4):  # more than the queue takes (backlog 0: one, on Linux)
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        yield URL(f"http://127.0.0.1:{port}")
    finally:
        for s in fillers:
            s.close()
        listener.close()


async def test_a_refused_port_is_unreachable() -> None:
    pool = h1.Pool(await _free_url(), limit=1, connect_timeout=5.0)
    with pytest.raises(errors.UpstreamUnreachable, match="cannot connect"):
        await pool.request(_get_head(), b"", 5.0)


async def test_a_connect_that_never_completes_is_a_timeout_and_a_timeout_error() -> None:
    with never_accepting() as url:
        pool = h1.Pool(url, limit=1, connect_timeout=0.3)
        with pytest.raises(errors.UpstreamTimeout, match="connecting") as caught:
            await pool.request(_get_head(), b"", 5.0)
    # Every wait above that catches TimeoutError treats it as a timeout (post(): a 504).
    assert isinstance(caught.value, TimeoutError)


async def test_no_answer_within_the_bound_is_a_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        await reader.read()

    async with pool_for(silent) as pool:
        with pytest.raises(errors.UpstreamTimeout):
            await pool.request(_get_head(), b"", 0.2)


async def test_a_close_before_the_answer_is_a_disconnect() -> None:
    async def close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.close()

    async with pool_for(close) as pool:
        with pytest.raises(errors.UpstreamDisconnected):
            await pool.request(_get_head(), b"", 5.0)
        assert pool.resent == 0  # a fresh connection: the close is the upstream's answer


async def test_a_close_mid_body_is_a_disconnect_after_the_bytes_that_came() -> None:
    cut = answering(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
    async with pool_for(cut) as pool:
        resp = await pool.request(_get_head(), b"", 5.0)
        assert await resp.readany() == b"hello"
        with pytest.raises(errors.UpstreamDisconnected, match="mid-response"):
            await resp.readany()
        assert not resp.complete


async def test_broken_chunk_framing_mid_body_is_a_protocol_error() -> None:
    bad = answering(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n", close=False
    )
    async with pool_for(bad) as pool:
        resp = await pool.request(_get_head(), b"", 5.0)
        with pytest.raises(errors.UpstreamProtocolError, match=r"bad HTTP/1\.1"):
            await resp.read()


async def test_a_bad_status_line_is_a_protocol_error_of_the_old_name() -> None:
    async with pool_for(answering(b"HTTP/9 nope\r\n\r\n", close=False)) as pool:
        with pytest.raises(h1.UpstreamProtocolError, match=r"bad HTTP/1\.1 from the upstream"):
            await pool.request(_get_head(), b"", 5.0)
    assert h1.UpstreamProtocolError is errors.UpstreamProtocolError


def _upstream(url: URL, connect_timeout: float = 5.0) -> HttpUpstream:
    return HttpUpstream(
        UpstreamSettings(
            name="u", url=str(url / "v1"), models=["m"], connect_timeout_seconds=connect_timeout
        )
    )


async def _post_error(upstream: HttpUpstream) -> GatewayError:
    try:
        with pytest.raises(GatewayError) as caught:
            await upstream.post("/chat/completions", b"{}", "r1")
        return caught.value
    finally:
        await upstream.close()


async def test_post_maps_each_failure_to_the_gateways_error() -> None:
    e = await _post_error(_upstream(await _free_url()))
    assert (e.status, e.code) == (502, "upstream_unavailable")
    assert "UpstreamUnreachable" in e.message
    with never_accepting() as url:
        e = await _post_error(_upstream(url, connect_timeout=0.3))
    assert (e.status, e.code) == (504, "upstream_timeout")
    async with raw_server(answering(b"garbage\r\n\r\n", close=False)) as url:
        e = await _post_error(_upstream(url))
    assert (e.status, e.code) == (502, PROTOCOL_ERROR)


async def test_post_sends_the_pace_it_is_given_and_none_without() -> None:
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError):  # the pool closed it
            while True:
                heads.append(await _read_head(reader))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()

    async with raw_server(handle) as url:
        upstream = _upstream(url)
        try:
            for pace in (12.5, None, 0.0):
                resp = await upstream.post("/chat/completions", b"{}", "r1", pace=pace)
                assert await resp.read() == b"ok"
        finally:
            await upstream.close()
    header = PACE_HEADER.encode()
    assert [header in h for h in heads] == [True, False, False]
    assert b"%s: 12.5\r\n" % header in heads[0]


async def test_the_clients_pace_reaches_the_upstream_on_every_attempt() -> None:
    """Through the whole path (front -> pipeline -> tail -> post) of an in-process gateway: the
    pace a streaming client asks for goes upstream with its first attempt and with the retry
    after a 503; a request without a pace sends none."""
    heads: list[bytes] = []
    stream = sse_reply([chat_chunk("hi"), chat_chunk("", "stop") + DONE])
    busy = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await _read_head(reader)
                if b"/models" in head.split(b"\r\n")[0]:
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                heads.append(head)
                writer.write(busy if len(heads) == 1 else stream.head + b"".join(stream.pieces))
                await writer.drain()

    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    async with raw_server(handle) as url:
        settings = Settings(upstreams=[UpstreamSettings(name="u", url=str(url / "v1"))])
        settings.server.port = 0
        async with gateway.running(settings) as (*_, port), aiohttp.ClientSession() as s:
            base = f"http://{settings.server.host}:{port}"
            for headers in ({PACE_HEADER: "1000"}, {}):
                async with s.post(base + "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 200 and (await r.read()).endswith(DONE)
    sent = [PACE_HEADER.encode() + b": 1000\r\n" in h for h in heads]
    assert sent == [True, True, False]  # the 503, its retry, then the request without a pace
