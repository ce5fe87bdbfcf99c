"""The upstream client (upstream/h1.py) on real sockets: the sim, an aiohttp app, and raw
servers that send exactly the bytes a case needs (a cut body, a bad head, no answer)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest
import uvloop
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from tests import procs
from tests.local_app import serving
from tests.scripted_upstream import FakeConn
from tokenpipe import sse
from tokenpipe.settings import UpstreamSettings
from tokenpipe.upstream import connection, h1
from tokenpipe.upstream import response as response_mod
from tokenpipe.upstream.errors import UpstreamDisconnected, UpstreamUnreachable
from tokenpipe.upstream.http import HttpUpstream
from tokenpipe.upstream.response import UpstreamResponse

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
STREAM_BODY = {
    "model": "sim-model",
    "stream": True,
    "max_tokens": 60,
    "messages": [{"role": "user", "content": "[[sim itl_ms=1]] push"}],
}


@contextlib.asynccontextmanager
async def raw_server(handle: Handler) -> AsyncIterator[URL]:
    """A loopback server whose every connection runs `handle`; yields its base URL."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield URL(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    finally:
        server.close()
        await server.wait_closed()


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """Reads one request's head and its body (by content-length); returns the head."""
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":")[1]))
    return head


def _post_head(url: URL, path: str, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n\r\n" % (
        (url.path.rstrip("/") + path).encode(),
        f"{url.host}:{url.port}".encode(),
        len(body),
    )


def _get_head(path: str = "/") -> bytes:
    return b"GET %s HTTP/1.1\r\nhost: upstream\r\n\r\n" % path.encode()


def _pool(url: URL, limit: int = 8) -> h1.Pool:
    return h1.Pool(url, limit=limit, connect_timeout=5.0)


@contextlib.asynccontextmanager
async def pool_for(handle: Handler) -> AsyncIterator[h1.Pool]:
    """A pool to a raw server running `handle`, closed when the block ends."""
    async with raw_server(handle) as url:
        pool = _pool(url)
        try:
            yield pool
        finally:
            pool.close()


def answering(data: bytes, close: bool = True) -> Handler:
    """A handler that reads one request, writes `data`, then closes (or waits for the client
    to close, `close=False`)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(data)
        await writer.drain()
        if close:
            writer.close()
        else:
            await reader.read()

    return handle


async def test_taken_and_declined_pieces_add_up_to_the_body_in_order(sim: procs.Service) -> None:
    url = URL(sim.url + "/v1")
    body = orjson.dumps(STREAM_BODY)
    pool = _pool(url)
    try:
        head = _post_head(url, "/chat/completions", body)
        reference = await (await pool.request(head, body, None)).read()
        resp = await pool.request(head, body, None)
        offers = 0
        order: list[tuple[str, bytes]] = []

        def take(data: bytes) -> bool:
            nonlocal offers
            offers += 1
            if offers % 2:  # every other offer is taken
                order.append(("taken", data))
                return True
            return False

        resp.take(take)
        while chunk := await resp.readany():
            order.append(("read", chunk))
    finally:
        pool.close()
    kinds = {kind for kind, _ in order}
    assert kinds == {"taken", "read"}  # both paths were used
    # Nothing was lost, duplicated or reordered: the same seeded answer as the reference
    # request (whose ids and times differ).
    got = sse.SSEDecoder().feed(b"".join(data for _, data in order))
    want = sse.SSEDecoder().feed(reference)
    assert [_choices(e.data) for e in got] == [_choices(e.data) for e in want]
    assert got[-1].data == sse.DONE and len(got) > 60


def _choices(data: bytes) -> object:
    return data if data == sse.DONE else orjson.loads(data)["choices"]


async def test_requests_reuse_keepalive_connections_within_the_limit() -> None:
    peers: list[int] = []

    async def hello(request: web.Request) -> web.Response:
        peername = request.transport.get_extra_info("peername") if request.transport else None
        peers.append(peername[1] if peername else -1)
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", hello)
    async with serving(app) as base:
        pool = _pool(URL(base), limit=1)
        try:
            for _ in range(2):  # one after the other, then three at once through one slot
                resp = await pool.request(_get_head(), b"", 5.0)
                assert (resp.status, await resp.read()) == (200, b"hello")

            async def fetch() -> bytes:
                resp = await pool.request(_get_head(), b"", 5.0)
                return await resp.read()

            assert await asyncio.gather(fetch(), fetch(), fetch()) == [b"hello"] * 3
        finally:
            pool.close()
    assert len(peers) == 5 and len(set(peers)) == 1


async def test_connection_close_answer_is_not_reused() -> None:
    accepted = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        await _read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async with pool_for(handle) as pool:
        for _ in range(2):
            resp = await pool.request(_get_head(), b"", 5.0)
            assert await resp.read() == b"ok"
    assert accepted == 2


async def test_cut_body_delivers_what_came_then_raises() -> None:
    cut = answering(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
    async with pool_for(cut) as pool:
        resp = await pool.request(_get_head(), b"", 5.0)
        received = b""
        with pytest.raises(UpstreamDisconnected):
            while chunk := await resp.readany():
                received += chunk
    assert received == b"0123456789"


async def test_body_without_length_ends_with_the_connection() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nhello ")
        await writer.drain()
        writer.write(b"world")
        writer.close()

    async with pool_for(handle) as pool:
        resp = await pool.request(_get_head(), b"", 5.0)
        assert await resp.read() == b"hello world"


async def test_informational_answers_are_skipped() -> None:
    hints = answering(
        b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-final: 1\r\n\r\nok",
        close=False,
    )
    async with pool_for(hints) as pool:
        resp = await pool.request(_get_head(), b"", 5.0)
        headers = resp.headers
        assert (resp.status, headers.get("link"), headers.get("x-final")) == (200, None, "1")
        assert await resp.read() == b"ok"


@pytest.mark.parametrize(
    "answer",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (h1.MAX_HEAD_BYTES + 1) + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"x: 1\r\n" * (connection.MAX_HEADERS + 1) + b"\r\n",
    ],
    ids=["not-http", "head-too-large", "too-many-headers"],
)
async def test_bad_answer_is_a_protocol_error(answer: bytes) -> None:
    # A protocol error of its own (not retried: asking again gets the same).
    async with pool_for(answering(answer, close=False)) as pool:
        with pytest.raises(h1.UpstreamProtocolError):
            await pool.request(_get_head(), b"", 5.0)


def _endless(head: bytes, closed: asyncio.Event) -> Handler:
    """An upstream that answers `head`, then 4 MiB of "a" in 16 KiB writes (a line that never
    ends), then silence; `closed` is set when the client has closed the connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(head)
        with contextlib.suppress(ConnectionError):  # the client's abort: a reset
            for _ in range(256):
                writer.write(b"a" * 16384)
                await writer.drain()
            await reader.read()  # returns when the client closes its end
        closed.set()

    return handle


@pytest.mark.parametrize("start", [b"x-big: ", b"x-"], ids=["endless-value", "endless-name"])
async def test_endless_header_is_cut_at_the_head_bound(start: bytes) -> None:
    """A header that never ends: the parser library joins its pieces until the line ends,
    so only a count of the head's bytes as they arrive bounds it. Cut past MAX_HEAD_BYTES
    (a protocol error, the connection closed), not at the request's timeout (30 s here)
    after the upstream sent as much as it liked."""
    closed = asyncio.Event()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n" + start
    async with pool_for(_endless(head, closed)) as pool:
        with pytest.raises(h1.UpstreamProtocolError, match="head too large"):
            await pool.request(_get_head(), b"", 30.0)
        await asyncio.wait_for(closed.wait(), 10.0)


@pytest.mark.parametrize(
    "start",
    [b"5\r\nhello\r\n0\r\nx-trailer: ", b"5\r\nhello\r\n5;ext="],
    ids=["endless-trailer", "endless-chunk-extension"],
)
async def test_endless_framing_after_the_head_is_cut(start: bytes) -> None:
    """Bytes that deliver nothing (a trailer that never ends, a chunk extension that never
    ends) are bounded as the head is: a protocol error past MAX_HEAD_BYTES, the body's part
    before them delivered, the connection closed; not a wait for the request's timeout
    while the parser binding joins the trailer's pieces."""
    closed = asyncio.Event()
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + start
    async with pool_for(_endless(head, closed)) as pool:
        resp = await pool.request(_get_head(), b"", 30.0)
        received = b""
        with pytest.raises(h1.UpstreamProtocolError, match="nothing"):
            async with asyncio.timeout(30.0):
                while chunk := await resp.readany():
                    received += chunk
        assert received == b"hello"
        await asyncio.wait_for(closed.wait(), 10.0)


async def test_no_answer_times_out_and_the_upstream_sees_the_close() -> None:
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        await reader.read()  # returns when the client closes its end
        closed.set()

    async with pool_for(handle) as pool:
        with pytest.raises(TimeoutError):
            await pool.request(_get_head(), b"", 0.2)
        await asyncio.wait_for(closed.wait(), 5.0)


async def test_closing_an_unfinished_response_closes_its_connection(sim: procs.Service) -> None:
    url = URL(sim.url + "/v1")
    body = orjson.dumps(STREAM_BODY)
    pool = _pool(url)
    try:
        resp = await pool.request(_post_head(url, "/chat/completions", body), body, None)
        assert await resp.readany()
        resp.close()
        assert resp.at_eof() and await resp.readany() == b""
        # The next request gets a fresh connection and a whole answer.
        resp = await pool.request(_post_head(url, "/chat/completions", body), body, None)
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    finally:
        pool.close()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


_CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


async def test_an_answered_response_owing_its_last_chunk_keeps_its_connection() -> None:
    # [DONE] first, the last chunk a moment later (aiohttp's and Starlette's write_eof): the
    # reader lets the response go at [DONE]; the connection reads the end and is reused.
    accepted = 0
    last_chunk = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        while True:
            try:
                await _read_head(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(_CHUNKED_HEAD + _chunk(b"data: [DONE]\n\n"))
            await writer.drain()
            await last_chunk.wait()
            last_chunk.clear()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with pool_for(handle) as pool:
        for _ in range(3):
            resp = await pool.request(_get_head(), b"", 5.0)
            assert await resp.readany() == b"data: [DONE]\n\n"
            resp.close(answered=True)
            assert resp.at_eof()
            last_chunk.set()
            for _ in range(100):  # until the connection read its end and is idle again
                if pool._idle:
                    break
                await asyncio.sleep(0.01)
    assert accepted == 1


@pytest.mark.parametrize("rest", [b"", _chunk(b"x" * (connection.FINISH_MAX_BYTES + 1))])
async def test_an_answered_response_that_never_ends_closes_its_connection(
    monkeypatch: pytest.MonkeyPatch, rest: bytes
) -> None:
    # Held open after its last event, or sending on: closed within the bounds, not pooled.
    monkeypatch.setattr(connection, "FINISH_SECONDS", 0.2)
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(_CHUNKED_HEAD + _chunk(b"data: [DONE]\n\n"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(rest)
        await reader.read()  # returns when the client closes its end
        closed.set()

    async with pool_for(handle) as pool:
        resp = await pool.request(_get_head(), b"", 5.0)
        assert await resp.readany() == b"data: [DONE]\n\n"
        resp.close(answered=True)
        await asyncio.wait_for(closed.wait(), 5.0)
        assert not pool._idle and pool._open == 0


async def test_unreachable_upstream_is_a_connection_error() -> None:
    async def ignore(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async with raw_server(ignore) as url:  # a port that was free a moment ago
        pass
    pool = _pool(url)
    with pytest.raises(UpstreamUnreachable):
        await pool.request(_get_head(), b"", 5.0)


def test_an_api_key_with_a_line_break_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TP_TEST_KEY", "sk-abc\r\nx-forged: 1")
    settings = UpstreamSettings(name="u", url="http://127.0.0.1:9/v1", api_key_env="TP_TEST_KEY")
    with pytest.raises(ValueError, match="line break"):
        HttpUpstream(settings)


async def test_closing_the_pool_ends_a_response_being_read(sim: procs.Service) -> None:
    url = URL(sim.url + "/v1")
    body = orjson.dumps(STREAM_BODY)
    pool = _pool(url)
    resp = await pool.request(_post_head(url, "/chat/completions", body), body, None)
    assert await resp.readany()
    reading = asyncio.create_task(resp.read())
    pool.close()  # e.g. the gateway shutting down past its drain deadline
    with pytest.raises(UpstreamDisconnected):
        await asyncio.wait_for(reading, 5.0)


async def test_a_large_backlog_is_read_in_bounded_pieces_in_order() -> None:
    body = bytes(range(256)) * 400  # 100 KiB: buffered whole, under the pause mark
    whole = answering(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    async with pool_for(whole) as pool:
        resp = await pool.request(_get_head(), b"", 5.0)
        async with asyncio.timeout(5):
            while not resp.complete:  # let all of it arrive before reading any
                await asyncio.sleep(0.01)
        pieces = [chunk async for chunk in resp.iter_any()]
    assert b"".join(pieces) == body
    assert len(pieces) == 2 and max(map(len, pieces)) == h1.READ_MAX


def gated_chunks(*gates: asyncio.Event) -> Handler:
    """A handler answering a chunked 200 whose body pieces "a", "b", ... each go out once
    their gate is set, then the end."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i, gate in enumerate(gates):
            await gate.wait()
            writer.write(b"1\r\n%c\r\n" % (ord("a") + i))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    return handle


async def test_a_taker_nudge_hands_the_reading_back_once_before_the_end() -> None:
    first, second = asyncio.Event(), asyncio.Event()
    async with pool_for(gated_chunks(first, second)) as pool:
        resp = await pool.request(_get_head(), b"", None)
        taken: list[bytes] = []

        def take(data: bytes) -> bool:
            taken.append(data)
            resp.nudge()
            return True

        resp.take(take)
        first.set()
        assert await resp.readany() == b""  # woken by the nudge, not by the end
        assert taken == [b"a"] and not resp.at_eof()
        resp.take(None)
        second.set()
        assert await resp.readany() == b"b"  # the nudge was spent: no second early return
        assert await resp.readany() == b"" and resp.at_eof()


async def test_a_nudge_before_the_read_returns_it_at_once_and_is_spent() -> None:
    first, second = asyncio.Event(), asyncio.Event()
    async with pool_for(gated_chunks(first, second)) as pool:
        resp = await pool.request(_get_head(), b"", None)
        first.set()
        assert await resp.readany() == b"a"
        resp.nudge()  # nothing buffered and nobody waiting yet
        assert await resp.readany() == b"" and not resp.at_eof()
        second.set()
        assert await resp.readany() == b"b"  # waited for the bytes: the nudge was spent
        assert await resp.readany() == b"" and resp.at_eof()


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_new_connection_has_no_delay_and_the_bounded_receive_buffer(loop_kind: str) -> None:
    """The loop connects (not a socket of our own): Nagle off and `receive_buffer_bytes` set
    on the connected socket, on either event loop."""
    BUF = 16384

    async def check() -> tuple[int, int]:
        async def hello(_: web.Request) -> web.Response:
            return web.Response(text="hello")

        app = web.Application()
        app.router.add_get("/", hello)
        async with serving(app) as base:
            pool = h1.Pool(URL(base), limit=1, connect_timeout=5.0, receive_buffer_bytes=BUF)
            try:
                resp = await pool.request(_get_head(), b"", 5.0)
                assert await resp.read() == b"hello"
                (conn,) = pool._members
                assert conn.transport is not None
                sock = conn.transport.get_extra_info("socket")
                return (
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
                )
            finally:
                pool.close()

    factory = uvloop.new_event_loop if loop_kind == "uvloop" else asyncio.SelectorEventLoop
    runner = asyncio.Runner(loop_factory=factory)
    with runner:
        nodelay, rcvbuf = runner.run(check())
    assert nodelay == 1
    # Linux doubles what is set, for its bookkeeping; unset, it starts at tcp_rmem's default
    # (128 KiB and more) and grows.
    assert BUF <= rcvbuf <= 2 * BUF


async def test_tiny_body_pieces_count_their_overhead_and_read_back_whole() -> None:
    """A body in 2-byte pieces: each counts its object's overhead against the watermarks
    (the connection pauses after ~3,000 of them, not 64k: ~20x their bytes as objects), and
    reading drains it in order, resuming the connection below the low watermark."""
    conn = FakeConn()
    resp = UpstreamResponse(conn, 200, CIMultiDict(), None)  # type: ignore[arg-type]
    fed = 0
    while not conn.paused:
        resp._feed(b"%02d" % (fed % 100))
        fed += 1
    per = 2 + response_mod.PIECE_BYTES
    assert fed == response_mod.HIGH_WATER // per + 1
    body = await resp.readany()  # all of it: fewer bytes than a read's most
    assert not conn.paused  # drained below the low watermark: reading resumes
    resp._feed(b"!")
    resp._end(None)
    while chunk := await resp.readany():
        body += chunk
    assert body == b"".join(b"%02d" % (i % 100) for i in range(fed)) + b"!"


async def test_waiters_given_up_stay_bounded_and_the_rest_keep_their_turn() -> None:
    """A full pool's waiters given up (newest first, the costliest order to find them in)
    are cancelled where they stand and skipped, the queue holds at most twice the live
    waiters, and the connection still goes to the live ones in arrival order."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with raw_server(hold) as url:
        pool = _pool(url, limit=1)
        try:
            held = await pool._acquire()  # the only connection
            served: list[int] = []

            async def wait(i: int) -> None:
                conn = await pool._acquire()
                served.append(i)
                pool.put_back(conn)

            tasks = [asyncio.create_task(wait(i)) for i in range(1000)]
            await asyncio.sleep(0)  # each task runs to its wait (one loop pass, no timing)
            assert len(pool._waiters) == 1000
            live = tasks[::10]
            given_up = [t for i, t in enumerate(tasks) if i % 10]
            for task in reversed(given_up):
                task.cancel()
            await asyncio.gather(*given_up, return_exceptions=True)
            assert all(t.cancelled() for t in given_up)
            assert len(pool._waiters) <= 2 * len(live)
            pool.put_back(held)
            await asyncio.wait_for(asyncio.gather(*live), 10)
            assert served == list(range(0, 1000, 10))
        finally:
            pool.close()
