"""The front's HTTP/1.1 server: an asyncio Protocol on httptools (llhttp), as the upstream
client already is, for the API routes.

Why not aiohttp's web server (which the engines still use): its request object, middleware
chain, router and `StreamResponse` machinery cost ~95 us of CPU per request, 22% of the
gateway's (benchmarks/profile_request.py, pinned); a request here is one parser callback set,
one small object and one write per answer. uvicorn's httptools protocol is the same idea
behind ASGI's message dicts. The same SSE answer under wrk (benchmarks/front_servers.py,
2026-12-06): this server 32 us of CPU a request, uvicorn's 1.12x, Granian's RSGI (Rust)
1.33x, aiohttp's 2.15x (docs/performance.md).

Bounds (each answered with a JSON 414 or 431 that echoes nothing, then the connection
closes; other unparsable requests get a 400 alike):
the request line and each header at most MAX_LINE bytes, the whole head MAX_HEAD, at most
MAX_HEADERS headers, and at most MAX_HEAD bytes in a row that deliver nothing after the head
(a chunked body's trailers or chunk lines). A new connection's head must arrive within
`idle_seconds`, and so must a head begun on a kept-alive connection, counted from its first
byte; an idle kept-alive connection is closed after `keepalive_seconds`. At most MAX_PIPELINED
requests wait behind the one being answered (then the socket is not read until it is
answered). A body is buffered up to wire.BODY_HIGH_WATER (then the socket is not read until
the handler reads it); bodies themselves are bounded by the edge (front/edge.py). When a
client disconnects, its request's handler task is cancelled at once, which closes the
upstream stream (unless the stream's last event already went out: then the handler ends as
answered).
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httptools

from tokenpipe.errors import GatewayError
from tokenpipe.front.refusal import Refused, refusal
from tokenpipe.front.wire import (
    LINGER_BYTES,
    Request,
    Response,
    StreamResponse,
    head_bytes,
    json_response,
)
from tokenpipe.http_fields import decoded

log = logging.getLogger("tokenpipe.front")

MAX_LINE = 16 * 1024
MAX_HEAD = 64 * 1024
MAX_HEADERS = 128
MAX_PIPELINED = 16
#: Seconds an unread body is read and dropped after the answer, before the close.
LINGER_SECONDS = 2.0

Handler = Callable[[Request], Awaitable[Response | StreamResponse]]
#: Called after each answer: (request, status, seconds taken).
Access = Callable[[Request, int, float], None]


class Hosting(Protocol):
    """What a connection needs of the server that accepted it (front/listener.py)."""

    app: Any
    handler: Handler
    idle_seconds: float
    keepalive_seconds: float
    access: Access | None
    decorate: Callable[[Request, dict[str, str]], None] | None
    connections: set[HttpConnection]


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests, answers them one at a time, in order."""

    def __init__(self, server: Hosting) -> None:
        self.server = server
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self._parser = httptools.HttpRequestParser(self)
        self._loop = asyncio.get_running_loop()
        # The request being parsed, and its head's parts.
        self._parsing: Request | None = None
        self._url = b""
        self._fields: list[bytes] = []  # the head's header names and values, alternating
        self._quiet = 0  # bytes read since the parser last delivered (a head, body, the end)
        self._in_head = False
        # Parsed requests in order; the first is being answered by `_task`.
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._kept = False  # the timer is the idle keep-alive's (not a head's deadline)
        self._paused = False  # reading paused (body high water or pipelined requests)
        self._body_paused = False
        self._writable: asyncio.Future[None] | None = None  # set while writing is paused
        self._closing = False
        self._lingering = 0  # bytes left to drop after the answer; > 0 while lingering

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport
        self.server.connections.add(self)
        self._arm(self.server.idle_seconds)  # the first head must arrive in time (slowloris)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._closing = True
        self._disarm()
        task = self._task
        if task is not None and not task.done():
            answering = self._queue[0] if self._queue else None
            sse = answering.sse if answering is not None else None
            # A stream whose last event went out is answered: its handler only finishes its
            # books (outcome, status, spans), within the request's deadline scope. Cut
            # there, a client that closes at [DONE] was recorded as a 499 that cancelled.
            if sse is None or not sse.ended:
                task.cancel()  # the client went away mid-answer: its upstream stream closes
        for request in self._queue:
            request.fail(ConnectionResetError("the client closed the connection"))
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)  # a waiting write sees the close (drain)
        # The parser holds this protocol (its callbacks), and this protocol the parser: a
        # cycle a connection, which only the garbage collector would free (a client that
        # opens a connection per request leaves one a request). Nothing is parsed after
        # the close.
        del self._parser

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingering -= min(len(data), self._lingering)
            if not self._lingering:
                self.transport.close()
            return
        if self._closing:
            return
        self._quiet += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Upgrade (h2c, websocket) is not served: this request is answered over
            # HTTP/1.1 and the connection closes, the upgraded bytes unread.
            if self._queue:
                self._queue[-1].keep_alive = False
            self._closing = True
        except Exception as e:  # every parser error is the client's
            # A callback's own exception (a bound: Refused) is the parser error's context.
            cause = e.__context__
            self._refuse(cause if isinstance(cause, Refused) else e)
            return
        # httptools joins a header's (and a trailer's) pieces itself, so a head or a trailer
        # trickled forever is cut here: at most MAX_HEAD bytes in a row that deliver nothing
        # (no whole head, no body piece, no end), after the read the last delivery was in.
        if self._quiet > MAX_HEAD:
            self._refuse(Refused("head too large" if self._in_head else "trailers too large"))

    def eof_received(self) -> bool | None:
        """The client closed its side: it is gone (as aiohttp's server took it), so the
        transport closes and its request's handler is cancelled (connection_lost)."""
        return None

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self._kept:  # a request on an idle kept-alive connection: its head is due in time
            self._kept = False
            self._arm(self.server.idle_seconds)
        self._in_head = True
        self._quiet = 0
        self._url = b""
        self._fields = []

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_LINE:
            raise Refused("request target too long", 414)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Per header only this; each line's bound and the decoding are C calls on all of
        # them at the head's end (a line is held at most until MAX_HEAD, data_received).
        self._fields += (name, value)  # (fewer instructions than two appends)
        if len(self._fields) > 2 * MAX_HEADERS:
            raise Refused("too many headers")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._quiet = 0
        fields, self._fields = self._fields, []
        # Each line at most MAX_LINE: looked at one by one only when all together are longer.
        if sum(map(len, fields)) > MAX_LINE and _longest(fields) > MAX_LINE:
            raise Refused("header too long")
        parser = self._parser
        request = Request(
            self,
            self.server.app,
            parser.get_method().decode("ascii", "replace"),
            self._url.decode("latin-1"),
            parser.get_http_version(),
            decoded(fields),
            parser.should_keep_alive() and parser.get_http_version() == "1.1",
        )
        self._parsing = request
        self._queue.append(request)
        if len(self._queue) > MAX_PIPELINED:
            self._pause()
        if self._task is None:
            self._start(request)

    def on_body(self, body: bytes) -> None:
        assert self._parsing is not None
        self._quiet = 0
        self._parsing.feed(body)

    def on_message_complete(self) -> None:
        self._quiet = 0
        if self._parsing is not None:
            self._parsing.end()
        self._parsing = None

    # For the request and its answer (wire.Connection)

    def pause_body(self) -> None:
        self._body_paused = True
        self._pause()

    def resume_body(self) -> None:
        self._body_paused = False
        if len(self._queue) <= MAX_PIPELINED:
            self._resume()

    def send_continue(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    async def drain(self) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        if self._writable is not None and not self._writable.done():
            await self._writable
            if self.transport.is_closing():
                raise ConnectionResetError("the client closed the connection")

    def decorate(self, request: Request, headers: dict[str, str]) -> None:
        hook = self.server.decorate
        if hook is not None:
            hook(request, headers)

    # Answering

    def _start(self, request: Request) -> None:
        self._disarm()
        request.task = self._task = self._loop.create_task(self._answer(request))

    async def _answer(self, request: Request) -> None:
        started = time.perf_counter()
        status = 499
        try:
            response = await self.server.handler(request)
            status = response.status
            if isinstance(response, StreamResponse):
                if not response.prepared:  # a handler's mistake: nothing can be sent
                    request.keep_alive = False
                else:
                    await response.write_eof()
            else:
                self._write(request, response)
        except (asyncio.CancelledError, ConnectionError) as e:
            request.keep_alive = False
            if not self.transport.is_closing():  # not the client leaving: say so, don't vanish
                log.warning("request %s ended by %s", request.rid, type(e).__name__)
                status = self._fail(request)
        except Exception:
            log.exception("internal error answering %s", request.path[:200])
            request.keep_alive = False
            status = self._fail(request)
        finally:
            if self.server.access is not None:
                self.server.access(request, status, time.perf_counter() - started)
        self._done(request)

    def _fail(self, request: Request) -> int:
        """A 500 for a request whose answer broke before its head went out (a stream that
        started ends at the close: its client sees no `[DONE]`)."""
        if request.sse is not None and request.sse.prepared:
            return 500
        headers = {"x-request-id": request.rid} if request.rid else None
        body = GatewayError(500, "Internal error in the gateway.").json()
        self._write(request, json_response(500, body, headers))
        return 500

    def _write(self, request: Request, response: Response) -> None:
        transport = self.transport
        if transport.is_closing():
            return
        self.decorate(request, response.headers)
        keep_alive = request.keep_alive and request.complete()
        head = head_bytes(response.status, response.headers, keep_alive, len(response.body))
        transport.write(head if request.method == "HEAD" else head + response.body)

    def _done(self, request: Request) -> None:
        self._task = None
        request.sse = request.error_event = None  # (no cycle with its answer to outlive it)
        if self._queue and self._queue[0] is request:
            self._queue.popleft()
        if self._closing or self.transport.is_closing():
            self.transport.close()
            return
        if not request.keep_alive or not request.complete():
            self._close_after(request)
            return
        if len(self._queue) <= MAX_PIPELINED and not self._body_paused:
            self._resume()
        if self._queue:
            self._start(self._queue[0])
        else:
            self._arm(self.server.keepalive_seconds)  # idle keep-alive
            self._kept = True

    def _close_after(self, request: Request) -> None:
        """Closes once the answer is out. A body still arriving is read and dropped first,
        for at most LINGER_SECONDS and LINGER_BYTES (lingering close)."""
        self._closing = True
        if request.complete():
            self.transport.close()
            return
        request.discard()
        self._lingering = LINGER_BYTES
        self._resume()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._loop.call_later(LINGER_SECONDS, self.transport.close)

    def _refuse(self, error: Exception) -> None:
        """A request the parser or the head bounds refused: a JSON 400 naming the kind of
        mistake, never the client's bytes, and the connection closes."""
        self._closing = True
        err = refusal(error, self.transport.get_extra_info("peername"))
        if self._parsing is not None and not self._in_head:
            # Its body broke the framing: its handler answers this error when it reads.
            self._parsing.fail(err)
            self._parsing.keep_alive = False
            return
        if self._task is not None:  # the answer in progress goes out first, then the close
            for request in self._queue:
                request.keep_alive = False
            return
        body = err.json()
        headers = {"Content-Type": "application/json"}
        self.transport.write(head_bytes(err.status, headers, False, len(body)) + body)
        self.transport.close()

    def close_when_done(self) -> asyncio.Task[None] | None:
        """For shutdown: closes now if idle, else after the answer in progress (returned)."""
        self._closing = True
        if self._task is None:
            self.transport.close()
        return self._task

    # Reading and the idle timer

    def _pause(self) -> None:
        if not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self._paused and not self.transport.is_closing():
            self._paused = False
            self.transport.resume_reading()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self._loop.call_later(seconds, self._idle)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle(self) -> None:
        self._timer = None
        if self._task is None:
            self.transport.close()


def _longest(fields: list[bytes]) -> int:
    """The longest header line's name and value, in bytes."""
    return max(map(operator.add, map(len, fields[::2]), map(len, fields[1::2])))
