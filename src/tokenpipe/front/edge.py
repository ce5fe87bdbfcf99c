"""The request edge of the HTTP front, shared by every API's routes: the request id, the
body read within its size and time bounds, JSON answers and error answers, and the client's
send buffers bounded for streams."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import zlib
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from tokenpipe import request_ids
from tokenpipe.control import bodies
from tokenpipe.control.deadline import Scope
from tokenpipe.errors import GatewayError
from tokenpipe.front.app import ErrorBody
from tokenpipe.front.wire import Request, Response, json_response
from tokenpipe.observe import logs
from tokenpipe.observe.server_timing import Timing
from tokenpipe.pipeline import Gateway

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell nginx-style proxies in front of us not to buffer
}
#: Status recorded for a request whose client went away before the end (nginx's convention).
CLIENT_CLOSED = 499
#: Bytes a compressed body is inflated by at a time: a gzip bomb meets the body limit (413)
#: in bounded memory.
_INFLATE_STEP = 64 * 1024


class Arrival(NamedTuple):
    """What every API route has in hand before it parses the body (`arrive`)."""

    started: float  # time.perf_counter() at arrival
    gateway: Gateway
    rid: str  # the request id
    key: str  # the client key's name
    scope: Scope  # the request's one deadline scope
    body: bytes


async def arrive(request: Request, *, x_api_key: bool = False) -> Arrival:
    """The first steps of every API route, in order: request id, auth (before any work; with
    `x_api_key`, Anthropic's header is accepted too), the deadline scope (from here on), the
    body within its size and time bounds."""
    started = time.perf_counter()
    request.timing = Timing(started)
    gw: Gateway = request.app.gateway
    rid = request_id(request)
    headers = request.headers
    bearer = headers.get("Authorization")
    if x_api_key:
        key = gw.auth.check_any(bearer, headers.get("x-api-key"))
    else:
        key = gw.auth.check(bearer)
    scope = gw.scope(headers)
    server = gw.settings.server
    body = await read_body(request, server.max_body_bytes, server.read_timeout_seconds)
    count = bodies.containers(body)
    if count >= bodies.PARSE_FREE_CONTAINERS:  # the key's share of the loop, before the parse
        gw.parsing.charge(key, bodies.parse_seconds(count))
    # Charged until the handler ends (front/http.py dispatch gives it back).
    request.held = gw.bodies.take(bodies.estimate(body, count))
    return Arrival(started, gw, rid, key, scope, body)


def error_response(
    e: GatewayError,
    request_id: str | None = None,
    body: ErrorBody | None = None,
    timing: Timing | None = None,
) -> Response:
    headers = dict(e.headers)
    if request_id:
        headers["x-request-id"] = request_id
    if timing is not None:  # the phases that ran, and the total up to this answer
        headers["Server-Timing"] = timing.header(time.perf_counter())
    return json_response(e.status, body(e) if body is not None else e.json(), headers)


def request_id(request: Request) -> str:
    known = request.rid
    if known is not None:
        return known
    rid = request.headers.get("x-request-id")
    # A client's id is echoed and logged: bounded (128 characters of a safe set), and refused
    # (replaced by a fresh one) when it looks like a key, which must never be echoed or logged.
    if rid is None or not _REQUEST_ID_RE.match(rid) or logs.redact(rid) != rid:
        rid = request_ids.new()
    request.rid = rid
    return rid


async def read_body(request: Request, limit: int, deadline: float) -> bytes:
    """The body, at most `limit` bytes (else 413), within `deadline` seconds (else 408: a
    client trickling its body must not hold a handler forever)."""
    length = request.content_length
    if length is not None and length > limit:
        raise GatewayError(
            413,
            f"Request body of {length} bytes is over the limit of {limit} bytes.",
            code="request_too_large",
        )
    inflate = _inflater(request.headers.get("Content-Encoding"))
    if request.complete():  # all of it arrived with the headers (the usual case): no timer
        return await _read_within_limit(request, limit, inflate)
    try:
        async with asyncio.timeout(deadline):
            return await _read_within_limit(request, limit, inflate)
    except TimeoutError:
        raise GatewayError(
            408, f"The request body did not arrive within {deadline:g} s.", code="request_timeout"
        ) from None


def _inflater(encoding: str | None) -> _Inflate | None:
    if encoding is None:
        return None
    name = encoding.strip().lower()
    if name in ("", "identity"):
        return None
    if name in ("gzip", "x-gzip", "deflate"):
        return _Inflate(name)
    raise GatewayError(
        415,
        "Content-Encoding must be gzip, deflate or identity.",
        code="unsupported_content_encoding",
    )


class _Inflate:
    """A gzip or deflate body inflated in steps of _INFLATE_STEP bytes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.inflater: zlib._Decompress | None = None

    def __call__(self, data: bytes) -> Iterator[bytes]:
        """The inflated pieces of `data`, one step at a time: the caller's limit stops the
        inflating (a bomb in one read never sits whole in memory)."""
        if self.inflater is None:
            if self.name == "deflate":  # zlib-wrapped (RFC 9110) or raw, as browsers send
                wbits = zlib.MAX_WBITS if data[:1] and data[0] & 0x0F == 8 else -zlib.MAX_WBITS
            else:
                wbits = 16 + zlib.MAX_WBITS
            self.inflater = zlib.decompressobj(wbits)
        d = self.inflater
        yield d.decompress(data, _INFLATE_STEP)
        while d.unconsumed_tail:
            yield d.decompress(d.unconsumed_tail, _INFLATE_STEP)

    def finished(self) -> bool:
        return self.inflater is None or self.inflater.eof


def _undecodable(e: Exception) -> GatewayError:
    return GatewayError(
        400, f"The request body could not be decoded ({type(e).__name__}).", code="invalid_body"
    )


async def _read_within_limit(request: Request, limit: int, inflate: _Inflate | None) -> bytes:
    # One bytearray, not a list of the pieces: a body of 2-byte chunks held ~20x its bytes
    # in objects (86 MiB for a 4 MiB body).
    body = bytearray()
    size = 0
    while True:
        chunk = await request.readany()  # raises the connection's 400 for broken framing
        if not chunk:
            break
        pieces: Iterable[bytes] = (chunk,) if inflate is None else inflate(chunk)
        try:
            for piece in pieces:
                size += len(piece)
                if size > limit:  # sizes count decompressed bytes
                    raise GatewayError(
                        413,
                        f"Request body is over the limit of {limit} bytes.",
                        code="request_too_large",
                    )
                body += piece
        except zlib.error as e:
            raise _undecodable(e) from None
    if inflate is not None and not inflate.finished():
        raise _undecodable(EOFError("truncated"))
    return bytes(body)


def bound_client_buffers(request: Request, sndbuf: int) -> None:
    """Keeps what waits for a slow client small, so the relay sees it and merges
    (relay/buffer.py)."""
    transport = request.transport
    if transport is None or not sndbuf or transport.get_write_buffer_limits()[1] == sndbuf:
        return  # done already for an earlier request on this connection
    # The event loop's own buffer: the write waits (drain) above this many bytes.
    transport.set_write_buffer_limits(high=sndbuf)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
