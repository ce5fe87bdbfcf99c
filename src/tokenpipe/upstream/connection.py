"""One keep-alive connection to an upstream (upstream/h1.py): an asyncio protocol that writes
a request and has llhttp (httptools) parse the answer straight into an UpstreamResponse.

Its failures are upstream/errors.py's: bytes that are not HTTP/1.1 are an
UpstreamProtocolError, a close or break before the response ended an UpstreamDisconnected.
"""

from __future__ import annotations

import asyncio
import select
import socket
from typing import Protocol, cast

import httptools

from tokenpipe.http_fields import decoded
from tokenpipe.upstream import reuse
from tokenpipe.upstream.errors import UpstreamDisconnected, UpstreamProtocolError
from tokenpipe.upstream.response import UpstreamResponse

#: Longest response head (status line and headers, bytes) accepted, and most bytes read in a
#: row that deliver nothing (no whole head, no piece of body, no end): trailers, chunk lines.
#: More is a protocol error. Counted as the bytes arrive (data_received): llhttp's binding
#: joins a header's pieces until its line ends, so a header or trailer that never ends would
#: otherwise grow without bound, each read copying all of it again, until a deadline.
MAX_HEAD_BYTES = 64 * 1024
#: Most header lines in a response head (OpenAI answers with ~25); more is a protocol error.
MAX_HEADERS = 256
#: A response let go after its last event (`finish`) may still owe the end of its framing
#: (the chunked body's last chunk): it is read for at most this long and this many bytes, then
#: the connection goes back to the pool, or is closed if either bound is passed. Upstreams
#: write [DONE] and the last chunk separately (aiohttp's and Starlette's `write_eof`): on
#: loopback 1 stream in 5 had [DONE] parsed before the last chunk arrived, and closing
#: those cost a new connection each (a TLS handshake on a real upstream).
FINISH_SECONDS = 1.0
FINISH_MAX_BYTES = 16 * 1024
#: TCP keep-alive on a connection kept idle past the pool's keep-alive (upstream/h1.py's
#: warm ones, up to 300 s): a probe after 60 s of silence, then every 10 s, 3 unanswered
#: ones and it is closed. NATs and load balancers forget a connection idle longer than
#: their timeout (Azure's load balancer: 4 min, without a reset by default), and a request
#: written into it would wait for its deadline; the probes keep their state, and find a
#: peer that went away.
KEEPALIVE_TCP = (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))


class Owner(Protocol):
    """What a connection tells the pool it belongs to (upstream/h1.py's Pool)."""

    def put_back(self, conn: Connection) -> None: ...
    def forget(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self, pool: Owner, receive_buffer_bytes: int = 0) -> None:
        self.pool = pool
        self.receive_buffer_bytes = receive_buffer_bytes  # 0: the kernel's autotuning
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.peer_closed = False  # its FIN was seen: never reused
        self.idle_since = 0.0
        # The socket's poll object, looked at before reuse (None: TLS, whose records may be
        # pending; upstream/reuse.py).
        self.poller: select.poll | None = None
        self.uses = 0  # requests sent on it
        self.answered = False  # a byte of the current request's answer arrived
        self._paused = False
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._in_head = False  # a request was sent and its answer's head is not complete
        self._quiet = 0  # bytes read since the parser last delivered (a head, body, the end)
        self._fields: list[bytes] = []  # the head's header names and values, alternating
        self._resp: UpstreamResponse | None = None
        self._timeout: float | None = None
        self._informational = False
        self._finishing: asyncio.TimerHandle | None = None  # `finish`'s bound
        self._finish_bytes = 0
        self._probed = False  # TCP keep-alive set (keep_warm)
        # The event loop it is connected on, looked up once (connection_made), not per
        # request: in CPython 3.11 `asyncio.get_running_loop()` makes a getpid system call.
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._loop = asyncio.get_running_loop()
        sock = transport.get_extra_info("socket")
        if sock is None:
            return
        if self.receive_buffer_bytes:
            # Connected, before the request is written: this only lowers the buffer (and
            # ends its autotuning), which needs no window scale of its own.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer_bytes)
        if transport.get_extra_info("sslcontext") is None:
            self.poller = reuse.watch(sock.fileno())

    def data_received(self, data: bytes) -> None:
        self._quiet += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # llhttp stops at a 101 (see on_headers_complete)
            self._fail(UpstreamProtocolError("the upstream switched protocols (101)"))
            self.abort()
            return
        except httptools.HttpParserError as e:
            # A callback's own error (a bound) is the parser error's context: it names it.
            cause = e.__context__
            named = cause if isinstance(cause, httptools.HttpParserError) else e
            self._fail(UpstreamProtocolError(f"bad HTTP/1.1 from the upstream: {named}"))
            self.abort()
            return
        # Nothing delivered for MAX_HEAD_BYTES (the bound is that plus one read: the bytes of
        # a read after its last delivery count from the next check). A head that ends
        # within a read is measured exactly in on_headers_complete.
        if self._quiet > MAX_HEAD_BYTES and not self.lost:
            why = "head too large" if self._in_head else "64 KiB that deliver nothing"
            self._fail(UpstreamProtocolError(f"bad HTTP/1.1 from the upstream: {why}"))
            self.abort()

    def eof_received(self) -> bool | None:
        self.peer_closed = True
        return None  # close the transport: a half-closed upstream sends nothing more

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._stop_finishing()
        self.pool.forget(self)
        resp = self._resp
        if resp is not None and not self._close_delimited(resp):
            self._fail(UpstreamDisconnected("the upstream connection broke mid-response"))
        elif resp is not None:
            resp._end(None)  # no length, not chunked: the body ends with the connection
            self._resp = None
        else:
            self._fail(UpstreamDisconnected("the upstream closed the connection"))
        # The parser holds this protocol (its callbacks), and this protocol the parser: a
        # cycle a connection, which only the garbage collector would free (one a stream cut
        # short, whose connection cannot be reused). Nothing is parsed after the close.
        del self.parser

    # -- llhttp callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._head is None:
            # An answer with no request waiting (a second response, bytes after a complete
            # one): what follows on this connection cannot be trusted. Parsing stops here and
            # the connection is closed (data_received), never reused.
            raise httptools.HttpParserError("a response with no request waiting")
        self.answered = True

    def on_header(self, name: bytes, value: bytes) -> None:
        # Per header only this: the bounds and the decoding are C calls on all of them at
        # the head's end (~38 instructions a header before, ~20 upstream headers an answer).
        self._fields += (name, value)  # (fewer instructions than two appends)
        if len(self._fields) > 2 * MAX_HEADERS:
            raise httptools.HttpParserError("too many headers")

    def on_headers_complete(self) -> None:
        # 1xx (e.g. 103 Early Hints): skipped. A 101 is too, and then ends the parse: no upgrade
        # is ever asked for, so the bytes after it are another protocol (data_received).
        self._quiet = 0
        fields, self._fields = self._fields, []
        if sum(map(len, fields)) > MAX_HEAD_BYTES:
            raise httptools.HttpParserError("head too large")
        if 100 <= self.parser.get_status_code() < 200:
            self._informational = True
            return
        self._in_head = False
        headers = decoded(fields)
        head = self._head
        status = self.parser.get_status_code()
        resp = UpstreamResponse(self, status, headers, self._timeout, self._loop)
        self._resp = resp
        if head is not None and not head.done():
            head.set_result(resp)

    def on_body(self, body: bytes) -> None:
        self._quiet = 0
        if self._resp is not None:
            self._resp._feed(body)
        elif self._finishing is not None:  # after the last event: dropped, bounded
            self._finish_bytes += len(body)
            if self._finish_bytes > FINISH_MAX_BYTES:
                self.abort()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        resp, self._resp = self._resp, None
        self._quiet = 0
        self._fields = []  # trailers: not read
        self._stop_finishing()
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
        assert self.transport is not None and self._loop is not None
        self._head = self._loop.create_future()
        self._in_head = True
        self._quiet = 0
        self._fields = []
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

    def finish(self) -> None:
        """The reader is done with the current response before its body ended (its last event
        came before the end of the framing): the rest is read and dropped, and the connection
        goes back to the pool at the end of the message, or is closed past FINISH_SECONDS or
        FINISH_MAX_BYTES (an upstream that goes on sending, or holds the body open)."""
        self._resp = None  # the body's rest is dropped (on_body)
        if self.lost or self.transport is None:
            return
        assert self._loop is not None  # (set with the transport, connection_made)
        self._finish_bytes = 0
        self._finishing = self._loop.call_later(FINISH_SECONDS, self.abort)
        self.resume()  # reading may have been paused for a full buffer

    def _stop_finishing(self) -> None:
        if self._finishing is not None:
            self._finishing.cancel()
            self._finishing = None

    def keep_warm(self) -> None:
        """Turns on TCP keep-alive probes (KEEPALIVE_TCP), once: the pool keeps this idle
        connection past its keep-alive."""
        if self._probed or self.transport is None:
            return
        self._probed = True
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in KEEPALIVE_TCP:
            if hasattr(socket, name):  # Linux's names; macOS has TCP_KEEPALIVE instead
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)

    def close(self) -> None:
        """Closes an idle connection politely (a FIN, where `abort` resets it): the pool
        has kept it long enough."""
        if self.transport is not None and not self.lost:
            self.transport.close()
        self.lost = True
        self.pool.forget(self)

    def abort(self) -> None:
        """Closes at once (a request abandoned mid-way: the upstream sees the close). A
        response still being read (the pool closed under it) ends with an error."""
        resp, self._resp = self._resp, None
        if resp is not None:
            resp._end(UpstreamDisconnected("the upstream connection was closed"))
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
