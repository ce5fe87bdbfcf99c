"""The HTTP front: OpenAI-compatible routes over aiohttp.

Order of work per request: request id, auth, body size, parse and validate, route, relay.
Client mistakes are 4xx with an OpenAI error body; nothing here returns a stack trace.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from importlib import resources
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from tokenpipe import request_ids, sse
from tokenpipe.control.flowgate import FlowGate
from tokenpipe.control.pacing import pace_gate
from tokenpipe.dialects import openai_schema as schema
from tokenpipe.errors import GatewayError
from tokenpipe.front import cors, drain
from tokenpipe.front.sse_out import emit_sse
from tokenpipe.observe import logs, metrics
from tokenpipe.observe.runtime import RuntimeSampler
from tokenpipe.pipeline import Call, Gateway
from tokenpipe.relay.tally import StreamTally
from tokenpipe.upstream.errors import UpstreamError, UpstreamProtocolError
from tokenpipe.upstream.http import PROTOCOL_ERROR

log = logging.getLogger("tokenpipe.front")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_JSON = "application/json"
_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell nginx-style proxies in front of us not to buffer
}
#: Status recorded for a request whose client went away before the end (nginx's convention).
CLIENT_CLOSED = 499

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
DRAIN: web.AppKey[drain.Drain] = web.AppKey("drain", drain.Drain)
#: Server-side phases (ms) a generating upstream reports on non-streamed answers
#: (`tokenpipe local`); passed through as they are. Streams carry them as an SSE comment.
_SERVER_TIMING_HEADERS = ("x-tokenpipe-queue-ms", "x-tokenpipe-prefill-ms", "x-tokenpipe-decode-ms")


def json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=body, content_type=_JSON, headers=headers)


def error_response(e: GatewayError, request_id: str | None = None) -> web.Response:
    headers = dict(e.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return json_response(e.status, e.json(), headers)


@web.middleware
async def errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error leaves as OpenAI-shaped JSON: ours, aiohttp's (404/405/413), or a bug's."""
    # Log lines written while serving this request carry its id (observe/logs.py).
    token = logs.REQUEST_ID.set(_request_id(request))
    try:
        return await handler(request)
    except GatewayError as e:
        return error_response(e, request.get("request_id"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(_routing_error(request, e), request.get("request_id"))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s", request.path)
        return error_response(
            GatewayError(500, "Internal error in the gateway."), request.get("request_id")
        )
    finally:
        logs.REQUEST_ID.reset(token)


def _routing_error(request: web.Request, e: web.HTTPException) -> GatewayError:
    """aiohttp's 404/405 as an error a client can act on: what is served, what is allowed."""
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        return GatewayError(
            405,
            f"{request.method} is not allowed on {_safe_path(request)}; use {allowed}.",
            code="method_not_allowed",
            headers={"Allow": allowed},
        )
    if isinstance(e, web.HTTPNotFound):
        served = ", ".join(
            f"{r.method} {r.resource.canonical}"
            for r in request.app.router.routes()
            if r.method not in ("HEAD", "OPTIONS") and r.resource is not None
        )
        return GatewayError(
            404,
            f"The gateway does not serve {request.method} {_safe_path(request)}. "
            f"It serves: {served}.",
            code="unknown_route",
        )
    return GatewayError(e.status, e.reason)


def _safe_path(request: web.Request) -> str:
    """The path as the client sent it, bounded and with keys masked: it is echoed back."""
    return logs.redact(request.path[:200])


def _request_id(request: web.Request) -> str:
    known: str | None = request.get("request_id")
    if known is not None:
        return known
    rid = request.headers.get("x-request-id")
    # A client's id is echoed and logged: bounded (128 characters of a safe set), and refused
    # (replaced by a fresh one) when it looks like a key, which must never be echoed or logged.
    if rid is None or not _REQUEST_ID.match(rid) or logs.redact(rid) != rid:
        rid = request_ids.new()
    request["request_id"] = rid
    return rid


async def _read_body(request: web.Request, limit: int, deadline: float) -> bytes:
    """The body, at most `limit` bytes (else 413), within `deadline` seconds (else 408: a
    client trickling its body must not hold a handler forever)."""
    content = request.content
    if content.is_eof():  # all of it arrived with the headers (the usual case): no timer
        return await _read_body_unbounded_in_time(request, limit)
    try:
        async with asyncio.timeout(deadline):
            return await _read_body_unbounded_in_time(request, limit)
    except TimeoutError:
        raise GatewayError(
            408, f"The request body did not arrive within {deadline:g} s.", code="request_timeout"
        ) from None


async def _read_body_unbounded_in_time(request: web.Request, limit: int) -> bytes:
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


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, schema.ChatRequest)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, schema.CompletionRequest)


async def _completion(
    request: web.Request,
    kind: type[schema.ChatRequest] | type[schema.CompletionRequest],
) -> web.StreamResponse:
    started = time.perf_counter()
    gw = request.app[GATEWAY]
    rid = _request_id(request)
    key = gw.auth.check(request.headers.get("Authorization"))
    scope = gw.scope(request.headers)  # the request's one deadline scope, from here on
    server = gw.settings.server
    body = await _read_body(request, server.max_body_bytes, server.read_timeout_seconds)
    req, obj = schema.parse(body, kind)
    gate = None
    if req.stream:
        gate = pace_gate(
            request.headers,
            req.stream_options.max_tokens_per_second if req.stream_options else None,
        )
    call = await gw.open(
        kind,
        req,
        obj,
        body,
        key=key,
        request_id=rid,
        started=started,
        headers=request.headers,
        scope=scope,
        pace=gate.rate if gate is not None else None,  # sent upstream (upstream/http.py)
    )
    status = CLIENT_CLOSED
    try:
        if call.uresp.status != 200 or not req.stream:
            status, response = await _unary(call, rid)
            response.headers.update(call.ctx.headers)
            return response
        sse_response = web.StreamResponse(
            status=200, headers={**_SSE_HEADERS, "x-request-id": rid, **call.ctx.headers}
        )
        _bound_client_buffers(request, gw.settings.server.stream_send_buffer_bytes)
        await sse_response.prepare(request)
        request[drain.STREAM] = sse_response  # a shutdown cut ends it with an error event
        status = await _relay_sse(call, sse_response, gate, request)
        return sse_response
    finally:
        call.close(status)


def _bound_client_buffers(request: web.Request, sndbuf: int) -> None:
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


async def _unary(call: Call, rid: str) -> tuple[int, web.Response]:
    """A non-streamed answer, or an upstream error before streaming: passed through as sent."""
    uresp, tally = call.uresp, call.tally
    try:
        body = await call.read_whole()
    except UpstreamProtocolError as e:  # bad chunk framing and the like
        raise GatewayError(502, f"Upstream broke the protocol: {e}.", code=PROTOCOL_ERROR) from None
    except (TimeoutError, UpstreamError):
        raise GatewayError(
            502, "Upstream closed the connection before answering.", code="upstream_error"
        ) from None
    headers = {"x-request-id": rid}
    status = uresp.status
    try:
        obj = orjson.loads(body)  # (orjson's depth limit makes deep nesting a decode error)
    except orjson.JSONDecodeError:
        obj = None
    if status == 200:
        if not isinstance(obj, dict):
            raise GatewayError(
                502, "Upstream sent a response that is not a JSON object.", code=PROTOCOL_ERROR
            )
        usage = obj.get("usage")
        tally.usage = usage if isinstance(usage, dict) else None
        for name in _SERVER_TIMING_HEADERS:  # the engine's own phases, for doctor and benches
            value = uresp.headers.get(name)
            if value is not None:
                headers[name] = value
        return status, json_response(status, body, headers)
    # Upstream error: keep its status when it is an HTTP error a client can act on, make sure
    # the body is OpenAI-shaped, and keep the rate-limit headers a client's retry logic reads.
    for name, value in uresp.headers.items():
        lname = name.lower()
        if lname.startswith("x-ratelimit-") or lname in ("retry-after", "retry-after-ms"):
            headers[name] = value
    if status < 400 or status > 599:
        status = 502
    if not (isinstance(obj, dict) and isinstance(obj.get("error"), dict)):
        body = GatewayError(
            status, f"Upstream answered with status {uresp.status}.", code="upstream_error"
        ).json()
    if status == 429 and "Retry-After" not in uresp.headers:
        headers.update(GatewayError(429, "").headers)
    return status, json_response(status, body, headers)


async def _relay_sse(
    call: Call, response: web.StreamResponse, gate: FlowGate | None, request: web.Request
) -> int:
    """Returns the status to record. Errors after the first byte become an SSE error event."""
    tally = call.tally
    emit, write_now, ready = emit_sse(response, request.writer, tally)
    try:
        error = await call.relay(emit, gate, write_now=write_now, ready=ready)
        # An error event is the stream's last: no [DONE] follows it (ARCHITECTURE.md), so a
        # client that stops at [DONE] never takes a cut answer for a whole one. The same holds
        # when the stream ended at the upstream's own error event (relayed as it came).
        if error is not None:
            error.message = _cut_message(tally, error.message)
            await response.write(sse.encode(error.json()))
    except ConnectionResetError:  # the client went away: the relay's direct write, or
        # aiohttp's server (its ClientConnectionResetError is a ConnectionResetError)
        return CLIENT_CLOSED
    except Exception:
        # A bug of ours mid-stream: the client still gets an error event and the end of the
        # stream, not a response that never ends (the middleware cannot answer any more).
        log.exception("internal error while streaming")
        error = GatewayError(500, _cut_message(tally, "internal error in the gateway"))
        await response.write(sse.encode(error.json()))
    await response.write_eof()
    return 200 if error is None else error.status


def _cut_message(tally: StreamTally, why: str) -> str:
    return (
        f"The stream was cut after {tally.deltas} content deltas: {why}. The answer is incomplete."
    )


async def list_models(request: web.Request) -> web.Response:
    _request_id(request)
    gw = request.app[GATEWAY]
    gw.auth.check(request.headers.get("Authorization"))
    names = await gw.router.models()
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "tokenpipe"} for n in names]
    return json_response(200, orjson.dumps({"object": "list", "data": data}))


async def metrics_endpoint(request: web.Request) -> web.Response:
    return web.Response(
        body=metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


async def healthz(request: web.Request) -> web.Response:
    return json_response(200, b'{"status":"ok"}')


async def readyz(request: web.Request) -> web.Response:
    if request.app[GATEWAY].draining:
        return json_response(
            503, GatewayError(503, "Draining: shutting down.", code="draining").json()
        )
    return json_response(200, b'{"status":"ready"}')


async def openapi(request: web.Request) -> web.Response:
    """The gateway's own OpenAPI description (front/openapi.json, shipped as package data)."""
    global _OPENAPI
    if _OPENAPI is None:
        _OPENAPI = (resources.files("tokenpipe.front") / "openapi.json").read_bytes()
    return json_response(200, _OPENAPI)


_OPENAPI: bytes | None = None


def build_app(gateway: Gateway) -> web.Application:
    app = web.Application(
        middlewares=[errors_middleware],
        # aiohttp's own cap, one byte over ours so that our 413 (OpenAI-shaped) answers first.
        client_max_size=gateway.settings.server.max_body_bytes + 1,
        handler_args={"max_field_size": 16384, "max_line_size": 16384},
    )
    app[GATEWAY] = gateway
    app[DRAIN] = drain.Drain()
    app.middlewares.append(drain.middleware(app[DRAIN], lambda: gateway.draining))
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/openapi.json", openapi)
    cors.install(app, gateway.settings.server.cors_origins)

    sampler = RuntimeSampler()

    async def start(app: web.Application) -> None:
        await gateway.start()
        sampler.start()

    async def close(app: web.Application) -> None:
        await sampler.stop()
        await gateway.close()

    app.on_startup.append(start)
    app.on_cleanup.append(close)
    return app
