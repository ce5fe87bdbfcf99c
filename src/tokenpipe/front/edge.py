"""The request edge of the HTTP front, shared by every API's routes: the request id, the
body read within its size and time bounds, JSON answers and error answers, and the client's
send buffers bounded for streams."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Callable
from typing import NamedTuple

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from tokenpipe import request_ids
from tokenpipe.control.deadline import Scope
from tokenpipe.errors import GatewayError
from tokenpipe.observe import logs
from tokenpipe.observe.server_timing import Timing
from tokenpipe.pipeline import Gateway

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_JSON = "application/json"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell nginx-style proxies in front of us not to buffer
}
#: Status recorded for a request whose client went away before the end (nginx's convention).
CLIENT_CLOSED = 499

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
#: Where an API request keeps its phase marks (Server-Timing), for the answer and for errors.
TIMING = "tokenpipe_timing"


class Arrival(NamedTuple):
    """What every API route has in hand before it parses the body (`arrive`)."""

    started: float  # time.perf_counter() at arrival
    gateway: Gateway
    rid: str  # the request id
    key: str  # the client key's name
    scope: Scope  # the request's one deadline scope
    body: bytes


async def arrive(request: web.Request, *, x_api_key: bool = False) -> Arrival:
    """The first steps of every API route, in order: request id, auth (before any work; with
    `x_api_key`, Anthropic's header is accepted too), the deadline scope (from here on), the
    body within its size and time bounds."""
    started = time.perf_counter()
    request[TIMING] = Timing(started)
    gw = request.app[GATEWAY]
    rid = request_id(request)
    bearer = request.headers.get("Authorization")
    if x_api_key:
        key = gw.auth.check_any(bearer, request.headers.get("x-api-key"))
    else:
        key = gw.auth.check(bearer)
    scope = gw.scope(request.headers)
    server = gw.settings.server
    body = await read_body(request, server.max_body_bytes, server.read_timeout_seconds)
    return Arrival(started, gw, rid, key, scope, body)


def timing_of(request: web.Request) -> Timing | None:
    """The request's phase marks (None: it is not an API request, or did not get that far)."""
    return request.get(TIMING)


def json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=body, content_type=_JSON, headers=headers)


#: An API's JSON body for an error (`Dialect.error_body`).
ErrorBody = Callable[[GatewayError], bytes]
#: The routes whose API writes errors in a shape of its own, by path; every other route
#: answers OpenAI's. Keyed by path, not set by the handler, so that every error on such a
#: route takes its shape: those raised before the handler runs (405, the drain's 503) and
#: those raised below it (auth, an unknown model, a 429 from the limiter) alike.
ERROR_BODIES: web.AppKey[dict[str, ErrorBody]] = web.AppKey("error_bodies", dict)
#: Routes that both APIs' clients call (GET /v1/models), by path: (a header, the error shape of
#: a request that carries it), e.g. Anthropic's for `anthropic-version`, which its SDKs send.
HEADER_ERROR_BODIES: web.AppKey[dict[str, tuple[str, ErrorBody]]] = web.AppKey(
    "header_error_bodies", dict
)


def error_response(
    e: GatewayError,
    request_id: str | None = None,
    body: ErrorBody | None = None,
    timing: Timing | None = None,
) -> web.Response:
    headers = dict(e.headers)
    if request_id:
        headers["x-request-id"] = request_id
    if timing is not None:  # the phases that ran, and the total up to this answer
        headers["Server-Timing"] = timing.header(time.perf_counter())
    return json_response(e.status, body(e) if body is not None else e.json(), headers)


def error_body_of(request: web.Request) -> ErrorBody | None:
    """The error shape of the request's route, or of its client on a shared route (None:
    OpenAI's)."""
    bodies = request.app.get(ERROR_BODIES)
    body = bodies.get(request.path) if bodies else None
    if body is None:
        shared = request.app.get(HEADER_ERROR_BODIES)
        entry = shared.get(request.path) if shared else None
        if entry is not None and entry[0] in request.headers:
            body = entry[1]
    return body


def request_id(request: web.Request) -> str:
    known: str | None = request.get("request_id")
    if known is not None:
        return known
    rid = request.headers.get("x-request-id")
    # A client's id is echoed and logged: bounded (128 characters of a safe set), and refused
    # (replaced by a fresh one) when it looks like a key, which must never be echoed or logged.
    if rid is None or not _REQUEST_ID_RE.match(rid) or logs.redact(rid) != rid:
        rid = request_ids.new()
    request["request_id"] = rid
    return rid


async def read_body(request: web.Request, limit: int, deadline: float) -> bytes:
    """The body, at most `limit` bytes (else 413), within `deadline` seconds (else 408: a
    client trickling its body must not hold a handler forever)."""
    content = request.content
    if content.is_eof():  # all of it arrived with the headers (the usual case): no timer
        return await _read_within_limit(request, limit)
    try:
        async with asyncio.timeout(deadline):
            return await _read_within_limit(request, limit)
    except TimeoutError:
        raise GatewayError(
            408, f"The request body did not arrive within {deadline:g} s.", code="request_timeout"
        ) from None


async def _read_within_limit(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        raise GatewayError(
            413,
            f"Request body of {length} bytes is over the limit of {limit} bytes.",
            code="request_too_large",
        )
    parts: list[bytes] = []
    size = 0
    while True:
        # Sizes count decompressed bytes (Content-Encoding: gzip/deflate): aiohttp inflates in
        # pieces of at most 64 KiB, so a gzip bomb meets the limit (413) in bounded memory.
        try:
            chunk = await request.content.readany()
        except (HttpProcessingError, RequestPayloadError) as e:  # it does not inflate
            # The rest of the body cannot be read either: marked ended so that aiohttp does
            # not read it again after the answer (and log a traceback for it).
            request.content.feed_eof()
            raise GatewayError(
                400,
                f"The request body could not be decoded ({type(e).__name__}).",
                code="invalid_body",
            ) from None
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise GatewayError(
                413, f"Request body is over the limit of {limit} bytes.", code="request_too_large"
            )
        parts.append(chunk)
    return b"".join(parts)


def bound_client_buffers(request: web.Request, sndbuf: int) -> None:
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
