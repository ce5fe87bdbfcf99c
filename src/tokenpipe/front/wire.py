"""One HTTP/1.1 exchange as the front's handlers see it: a `Request` (its head parsed, its body
read in bounded pieces), a `Response` (a whole body) and a `StreamResponse` (chunked: SSE).

The connection that parses them is front/server.py's; this module holds no socket logic but
the writes of an answer's bytes.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qsl, unquote

from multidict import CIMultiDict, MultiDict

from tokenpipe.http_fields import PIECE_BYTES

if TYPE_CHECKING:
    from tokenpipe.observe.server_timing import Timing

#: Bytes of a request body buffered before the connection stops reading its socket (resumed
#: when the handler reads it: `readany` takes all that is buffered): a client cannot make
#: the gateway buffer more.
BODY_HIGH_WATER = 256 * 1024
#: Bytes of an unread body read and dropped after the answer before the connection closes
#: (lingering close: closing with unread bytes makes the kernel reset the connection, which
#: can destroy the answer, e.g. a 413, before the client has read it).
LINGER_BYTES = 16 << 20

_JSON = "application/json"


class Connection(Protocol):
    """What a request and its answer need of the connection (front/server.py)."""

    transport: asyncio.Transport

    def pause_body(self) -> None: ...
    def resume_body(self) -> None: ...
    def send_continue(self) -> None: ...
    async def drain(self) -> None: ...
    def decorate(self, request: Request, headers: dict[str, str]) -> None: ...


class Request:
    """A request's head and its body, fed by the connection as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_continue",
        "_eof",
        "_error",
        "_paused",
        "_waiter",
        "app",
        "conn",
        "discarding",
        "error_event",
        "headers",
        "held",
        "keep_alive",
        "method",
        "path",
        "query_string",
        "rid",
        "sse",
        "task",
        "timing",
        "version",
    )

    def __init__(
        self,
        conn: Connection,
        app: Any,
        method: str,
        target: str,
        version: str,
        headers: CIMultiDict[str],
        keep_alive: bool,
    ) -> None:
        self.conn = conn
        self.app = app  # the front (front/app.py)
        self.method = method
        path, _, self.query_string = target.partition("?")
        self.path = unquote(path) if "%" in path else path  # decoded, as routes are
        self.version = version  # "1.1" or "1.0"
        self.headers = headers
        self.keep_alive = keep_alive
        self.rid: str | None = None  # the request id, once edge.request_id chose it
        self.timing: Timing | None = None  # Server-Timing marks of an API request
        self.sse: StreamResponse | None = None  # a started stream, for the shutdown cut
        self.error_event: Callable[[Any], bytes] | None = None  # that stream's API's
        self.discarding = False  # the rest of the body is dropped as it arrives
        self.held = 0  # its body's charge against the gateway's BodyMemory, while it lasts
        self.task: asyncio.Task[Any] | None = None  # the connection's task answering it
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False  # this body paused the connection's reading
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        # An `Expect: 100-continue` client waits for this before it sends its body: sent at
        # the first read, so a request refused before (auth, 413) never gets it.
        self._continue = version == "1.1" and (headers.get("Expect", "").lower() == "100-continue")

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isascii() and value.isdigit() else None

    @property
    def query(self) -> MultiDict[str]:
        return MultiDict(parse_qsl(self.query_string, max_num_fields=100))

    @property
    def transport(self) -> asyncio.Transport:
        return self.conn.transport

    # The body, read by the handler.

    def complete(self) -> bool:
        """All of the body arrived (read or not)."""
        return self._eof

    async def readany(self) -> bytes:
        """What of the body has arrived and not been read, joined; b"" at its end; raises
        what ended it (the connection's GatewayError for a body that broke the framing)."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            if self._continue:
                self._continue = False
                self.conn.send_continue()
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self.conn.resume_body()
        return chunk

    # Fed by the connection.

    def feed(self, data: bytes) -> None:
        if self.discarding:
            return
        self._chunks.append(data)
        # Each piece counts its object's overhead too (PIECE_BYTES).
        self._buffered += len(data) + PIECE_BYTES
        if self._buffered > BODY_HIGH_WATER and not self._paused:
            self._paused = True
            self.conn.pause_body()
        self._wake()

    def end(self) -> None:
        self._eof = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def discard(self) -> None:
        """The handler is done with the body: what is buffered and what comes is dropped."""
        self.discarding = True
        self._chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self.conn.resume_body()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Response:
    """A whole answer: its status, headers and body."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        content_type: str | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers = {} if headers is None else dict(headers)
        if content_type is not None:
            self.headers["Content-Type"] = content_type


def json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(status, body, headers, _JSON)


class StreamResponse:
    """A chunked answer (SSE) written piece by piece. Its head is held until the first
    write and goes out in one `transport.write` with it. Over HTTP/1.0 the body is not
    framed, and the connection closes at its end."""

    __slots__ = (
        "_head",
        "_transport",
        "chunked",
        "ended",
        "headers",
        "prepared",
        "request",
        "status",
    )

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers = {} if headers is None else dict(headers)
        self.prepared = False
        self.ended = False
        self.chunked = True
        self._head: bytes | None = None
        self.request: Request | None = None
        self._transport: asyncio.Transport | None = None  # the request's, once prepared

    async def prepare(self, request: Request) -> None:
        self.request = request
        self.chunked = request.version == "1.1"
        if not self.chunked:
            request.keep_alive = False
        else:
            self.headers["Transfer-Encoding"] = "chunked"
        request.conn.decorate(request, self.headers)
        self._head = head_bytes(self.status, self.headers, request.keep_alive)
        self._transport = request.conn.transport
        self.prepared = True

    @property
    def transport(self) -> asyncio.Transport:
        assert self.request is not None, "prepare() first"
        return self.request.conn.transport

    def send(self, data: bytes, last: bool = False) -> None:
        """Writes `data` now, never waiting (the relay's direct write, once per token).
        `last`: the stream's last event; the body's end goes in the same write (one syscall
        fewer a request), and nothing may follow (RuntimeError)."""
        if self.ended:
            raise RuntimeError("the stream has ended")
        transport = self._transport
        assert transport is not None, "prepare() first"
        if transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        if not data and not last:
            return  # (an empty chunk would end the body)
        if self.chunked:
            framing = b"%x\r\n%b\r\n0\r\n\r\n" if last else b"%x\r\n%b\r\n"
            data = framing % (len(data), data) if data else b"0\r\n\r\n"
        if self._head is not None:
            data, self._head = self._head + data, None
        self.ended = last
        transport.write(data)

    async def write(self, data: bytes, last: bool = False) -> None:
        """Writes `data`, then waits while the client's send buffer is over its high mark
        (not after the last: nothing follows it, and the close flushes what is buffered)."""
        if data:
            self.send(data, last)
            if not last:
                await self.drain()

    async def drain(self) -> None:
        assert self.request is not None
        await self.request.conn.drain()

    async def write_eof(self) -> None:
        if self.ended:
            return
        self.ended = True
        transport = self.transport
        if transport.is_closing():
            return
        data = b"0\r\n\r\n" if self.chunked else b""
        if self._head is not None:
            data, self._head = self._head + data, None
        if data:
            transport.write(data)


# The head's bytes.

#: "HTTP/1.1 200 OK\r\n" by status (any other status: "Unknown").
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_date: tuple[int, bytes] = (0, b"")


def _date_header() -> bytes:
    """`Date` (RFC 9110 requires it), formatted once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, f"Date: {formatdate(now, usegmt=True)}\r\n".encode())
    return _date[1]


def head_bytes(status: int, headers: dict[str, str], keep_alive: bool, length: int = -1) -> bytes:
    """The status line and headers. `length` >= 0 adds Content-Length. A value holding CR or
    LF is dropped (header injection: some values come from upstreams)."""
    # Joined by C calls alone (no bytecode a header). Each line has one CR and one LF of its
    # own: more means a value holds one, and only then are the values tested one by one.
    text = "\r\n".join(map(": ".join, headers.items())) + "\r\n" if headers else ""
    n = len(headers)
    if text.count("\n") != n or text.count("\r") != n:
        text = "".join(
            [f"{k}: {v}\r\n" for k, v in headers.items() if "\r" not in v and "\n" not in v]
        )
    lines = [
        _STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status,
        text.encode("latin-1", "replace"),
    ]
    if length >= 0:
        lines.append(b"Content-Length: %d\r\n" % length)
    if not keep_alive:
        lines.append(b"Connection: close\r\n")
    lines.append(_date_header())
    lines.append(b"\r\n")
    return b"".join(lines)
