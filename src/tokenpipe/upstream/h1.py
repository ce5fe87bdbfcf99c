"""A lean HTTP/1.1 client for the requests the gateway sends upstream: a pool of keep-alive
connections, each request one write, the response parsed by llhttp (httptools) straight into
the response object, and each piece of a streamed body offered to a callback as it is parsed.

Why not aiohttp's ClientSession: it builds a request object, merges header dicts, runs its
trace, cookie, proxy and redirect machinery and a payload writer for every request. That was
the largest single cost of a gateway request (profiled: ~15% of the gateway's CPU per request,
more than all of its own features), and every request is paid for again by every request
queued behind it in a burst. The gateway needs one request shape only: a POST (or a GET of
/models) of a body it already holds, to a URL from its config, with headers from its config.

The response offers what the gateway reads (`status`, `headers`, `readany()`, `iter_any()`,
`read()`, `close()`), and its errors are aiohttp's client exceptions, which the gateway's
handlers already catch for its HTTP front.

Bounds: at most `limit` connections per upstream (a request beyond waits for one to be
released); idle connections are closed after `keepalive_s`; a response buffers at most
`HIGH_WATER` bytes before the socket stops being read (TCP backpressure on the upstream).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import cast

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from tokenpipe.upstream.reuse import resendable, reusable

#: Buffered body bytes above which the socket stops being read, and below which it resumes
#: (aiohttp's StreamReader uses the same pair).
HIGH_WATER = 128 * 1024
LOW_WATER = 64 * 1024
#: Most bytes one `readany()` returns: what was buffered, merged, up to this much (the relay's
#: bounds count one read on top of its watermark).
READ_MAX = 64 * 1024
#: Longest response head (status line and headers, bytes) accepted; more is a protocol error.
MAX_HEAD_BYTES = 64 * 1024

Taker = Callable[[bytes], bool]


class UpstreamProtocolError(aiohttp.ClientError):
    """The upstream's bytes are not HTTP/1.1 as asked for: a bad status line, header or chunk
    framing, or a protocol switch (101) nobody asked for. Deterministic: asking again gets the
    same, so the gateway reports it (502 upstream_protocol_error) and does not retry it."""


class UpstreamResponse:
    """One upstream response; its body is read with `readany()` (b"" at the end) or pushed to
    a taker (`take`)."""

    __slots__ = (
        "_buffer",
        "_conn",
        "_eof",
        "_error",
        "_fatal",
        "_nudged",
        "_read_timeout",
        "_size",
        "_taker",
        "_waiter",
        "headers",
        "status",
    )

    def __init__(
        self, conn: Connection, status: int, headers: CIMultiDict[str], timeout: float | None
    ):
        self.status = status
        self.headers = CIMultiDictProxy(headers)
        self._conn: Connection | None = conn
        self._buffer: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None  # raised once the buffered bytes are read
        self._fatal: BaseException | None = None  # raised by the next read (set_exception)
        self._waiter: asyncio.Future[None] | None = None
        self._taker: Taker | None = None
        self._nudged = False
        self._read_timeout = timeout

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("content-length")
        return int(value) if value is not None and value.isdigit() else None

    # -- fed by the connection --------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        taker = self._taker
        if taker is not None and not self._buffer and taker(data):
            return
        self._buffer.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _end(self, error: BaseException | None) -> None:
        if not self._eof and error is not None:
            self._error = error
        self._eof = True
        self._conn = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the gateway ----------------------------------------------------------------

    def take(self, taker: Taker | None) -> None:
        """Offers each later piece of body to `taker` (True: taken, not buffered) while
        nothing is buffered: pieces reach the reader in the order they came."""
        self._taker = taker

    def nudge(self) -> None:
        """Makes the waiting `readany()`, or the next one, return once: with what is buffered
        by then, or b"" before the end (tell them apart with `at_eof()`). A taker's way to
        hand the reading back to the task parked in `readany()`."""
        self._nudged = True
        self._wake()

    def set_exception(self, error: BaseException) -> None:
        """Makes the next read raise `error` (a taker's failure, raised by the reader)."""
        self._fatal = error
        self._wake()

    def at_eof(self) -> bool:
        return self._eof and not self._buffer

    async def readany(self) -> bytes:
        """What is buffered (merged), waiting for some if nothing is; b"" at the end (or when
        nudged). Raises aiohttp.ClientPayloadError if the connection broke before the body
        ended (after the bytes that came before the break)."""
        nudged, self._nudged = self._nudged, False
        while not self._buffer:
            if self._fatal is not None:
                raise self._fatal
            if self._error is not None:
                raise self._error
            if self._eof or nudged:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                if self._read_timeout is None:
                    await self._waiter
                else:
                    async with asyncio.timeout(self._read_timeout):
                        await self._waiter
            finally:
                self._waiter = None
            nudged, self._nudged = self._nudged, False
        if self._fatal is not None:
            raise self._fatal
        buffer = self._buffer
        if self._size <= READ_MAX:
            data = buffer.popleft() if len(buffer) == 1 else b"".join(buffer)
            buffer.clear()
        else:
            parts: list[bytes] = []
            n = 0
            while n < READ_MAX:
                chunk = buffer.popleft()
                if n + len(chunk) > READ_MAX:
                    buffer.appendleft(chunk[READ_MAX - n :])
                    chunk = chunk[: READ_MAX - n]
                parts.append(chunk)
                n += len(chunk)
            data = b"".join(parts)
        self._size -= len(data)
        if self._conn is not None and self._size < LOW_WATER:
            self._conn.resume()
        return data

    @property
    def complete(self) -> bool:
        """The whole body arrived (some of it may still wait to be read)."""
        return self._eof and self._error is None

    async def iter_any(self) -> AsyncIterator[bytes]:
        while chunk := await self.readany():
            yield chunk

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.iter_any()]
        return b"".join(parts)

    def close(self) -> None:
        """Done with the response: a finished one's connection is already back in the pool;
        an unfinished one's is closed (its rest would precede the next response, and the
        upstream sees the request abandoned)."""
        self._eof = True  # first: the abort below must not record an error for this reader
        self._buffer.clear()
        self._size = 0
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()


class Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.peer_closed = False  # its FIN was seen: never reused
        self.idle_since = 0.0
        self.fd = -1  # the socket polled before reuse (-1: TLS, whose records may be pending)
        self.uses = 0  # requests sent on it
        self.answered = False  # a byte of the current request's answer arrived
        self._paused = False
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._head_size = 0
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._resp: UpstreamResponse | None = None
        self._timeout: float | None = None
        self._informational = False

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and transport.get_extra_info("sslcontext") is None:
            self.fd = sock.fileno()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # llhttp stops at a 101 (see on_headers_complete)
            self._fail(UpstreamProtocolError("the upstream switched protocols (101)"))
            self.abort()
        except httptools.HttpParserError as e:
            self._fail(UpstreamProtocolError(f"bad HTTP/1.1 from the upstream: {e}"))
            self.abort()

    def eof_received(self) -> bool | None:
        self.peer_closed = True
        return None  # close the transport: a half-closed upstream sends nothing more

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        resp = self._resp
        if resp is not None and not self._close_delimited(resp):
            self._fail(aiohttp.ClientPayloadError("the upstream connection broke mid-response"))
        elif resp is not None:
            resp._end(None)  # no length, not chunked: the body ends with the connection
            self._resp = None
        else:
            self._fail(aiohttp.ServerDisconnectedError("the upstream closed the connection"))

    # -- llhttp callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._head is None:
            # An answer with no request waiting (a second response, bytes after a complete
            # one): what follows on this connection cannot be trusted. Parsing stops here and
            # the connection is closed (data_received), never reused.
            raise httptools.HttpParserError("a response with no request waiting")
        self.answered = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value)
        if self._head_size > MAX_HEAD_BYTES:
            raise httptools.HttpParserError("response head too large")
        self._headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        # 1xx (e.g. 103 Early Hints): skipped. A 101 is too, and then ends the parse: no upgrade
        # is ever asked for, so the bytes after it are another protocol (data_received).
        if 100 <= self.parser.get_status_code() < 200:
            self._informational = True
            self._headers = CIMultiDict()
            return
        head = self._head
        resp = UpstreamResponse(self, self.parser.get_status_code(), self._headers, self._timeout)
        self._resp = resp
        if head is not None and not head.done():
            head.set_result(resp)

    def on_body(self, body: bytes) -> None:
        if self._resp is not None:
            self._resp._feed(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        resp, self._resp = self._resp, None
        reuse = self.parser.should_keep_alive() and not self.lost
        if resp is not None:
            resp._end(None)
        self._head = None
        if reuse:
            self.resume()
            self.pool.put_back(self)
        else:
            self.abort()

    # -- used by the pool and the response ---------------------------------------------------

    def send(self, data: bytes, timeout: float | None) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        self._head = asyncio.get_running_loop().create_future()
        self._head_size = 0
        self._headers = CIMultiDict()
        self._timeout = timeout
        self.uses += 1
        self.answered = False
        self.transport.write(data)
        return self._head

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.lost:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        """Closes at once (a request abandoned mid-way: the upstream sees the close). A
        response still being read (the pool closed under it) ends with an error."""
        resp, self._resp = self._resp, None
        if resp is not None:
            resp._end(aiohttp.ClientPayloadError("the upstream connection was closed"))
        if self.transport is not None and not self.lost:
            self.transport.abort()
        self.lost = True
        self.pool.forget(self)

    def _fail(self, error: BaseException) -> None:
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(error)
        resp, self._resp = self._resp, None
        if resp is not None:
            resp._end(error)

    def _close_delimited(self, resp: UpstreamResponse) -> bool:
        h = resp.headers
        return "content-length" not in h and "chunked" not in h.get("transfer-encoding", "")


class Pool:
    """Keep-alive connections to one origin, at most `limit` at a time."""

    def __init__(
        self,
        url: URL,
        *,
        limit: int,
        connect_timeout: float,
        receive_buffer_bytes: int = 0,
        keepalive_s: float = 30.0,
    ) -> None:
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"upstream URL must be http(s)://host[:port]/...: {url}")
        self.host = url.host
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if url.scheme == "https" else None
        )
        self.host_header = url.host_port_subcomponent  # [v6]:port; no default port
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.receive_buffer_bytes = receive_buffer_bytes
        self.keepalive_s = keepalive_s
        # LIFO: the most recently used connection is the warmest. Bound: `limit`.
        self._idle: list[Connection] = []
        self._open = 0  # connections open or opening; bound: `limit`
        # Requests waiting for a connection; bound: the requests in flight (admission's bound).
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._members: set[Connection] = set()
        self.resent = 0  # requests sent again after a reused connection closed under them

    async def request(self, head: bytes, body: bytes, timeout: float | None) -> UpstreamResponse:
        """Sends `head` (the request line and headers, ending in a blank line) and `body` in
        one write; returns once the response head arrived (within `timeout` seconds if set).
        A task cancelled while it waits closes the connection. A request that failed on a
        reused connection before any byte of its answer is sent once more, on a fresh one
        (upstream/reuse.py; `resent` counts them)."""
        conn = await self._acquire()
        try:
            return await self._exchange(conn, head, body, timeout)
        except aiohttp.ServerDisconnectedError:
            if not resendable(conn):
                raise
        self.resent += 1
        return await self._exchange(await self._acquire(fresh=True), head, body, timeout)

    async def _exchange(
        self, conn: Connection, head: bytes, body: bytes, timeout: float | None
    ) -> UpstreamResponse:
        try:
            head_future = conn.send(head + body if len(body) < 65536 else head, timeout)
            if len(body) >= 65536:
                assert conn.transport is not None
                conn.transport.write(body)  # no copy of a large body
            if timeout is None:
                return await head_future
            async with asyncio.timeout(timeout):
                return await head_future
        except BaseException:
            conn.abort()
            raise

    async def _acquire(self, fresh: bool = False) -> Connection:
        """An idle connection that passes the check before reuse, else a new one once there
        is room; `fresh`: always a new one (an idle one is closed if that makes the room)."""
        now = time.monotonic()
        while True:
            while self._idle and not fresh:
                conn = self._idle.pop()
                if reusable(conn, now, self.keepalive_s):
                    return conn
                conn.abort()
            if fresh and self._open >= self.limit and self._idle:
                self._idle.pop(0).abort()  # the coldest one
                continue
            if self._open < self.limit:
                break
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then cancelled: the turn passes on
                raise
        self._open += 1
        try:
            return await self._connect()
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                infos = await loop.getaddrinfo(
                    self.host, self.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
                )
                error: OSError | None = None
                for family, type_, proto, _, addr in infos:
                    sock = socket.socket(family, type_, proto)
                    try:
                        if self.receive_buffer_bytes:
                            # Before connect: the TCP window scale is fixed by the handshake.
                            sock.setsockopt(
                                socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer_bytes
                            )
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        sock.setblocking(False)
                        await loop.sock_connect(sock, addr)
                    except OSError as e:
                        sock.close()
                        error = e
                        continue
                    except BaseException:
                        sock.close()
                        raise
                    _, conn = await loop.create_connection(
                        functools.partial(Connection, self),
                        sock=sock,
                        ssl=self.ssl,
                        server_hostname=self.host if self.ssl else None,
                    )
                    if conn.lost:  # closed by the upstream as soon as accepted
                        raise aiohttp.ServerDisconnectedError()
                    self._members.add(conn)
                    return conn
                raise error or OSError(f"no address for {self.host}")
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(
                f"connecting to {self.host_header} timed out"
            ) from None
        except OSError as e:
            raise aiohttp.ClientOSError(
                e.errno, f"cannot connect to {self.host_header}: {e}"
            ) from None

    def put_back(self, conn: Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        self._wake_one()

    def forget(self, conn: Connection) -> None:
        """A connection closed: its place is free."""
        if conn in self._members:
            self._members.discard(conn)
            self._open -= 1
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        for conn in list(self._members):
            conn.abort()
        self._idle.clear()
