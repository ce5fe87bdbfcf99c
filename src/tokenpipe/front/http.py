"""The HTTP front: OpenAI-compatible routes over aiohttp.

Order of work per request: request id, auth, body size, parse and validate, route, relay.
Client mistakes are 4xx with an OpenAI error body; nothing here returns a stack trace.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from tokenpipe import sse
from tokenpipe.context.budget import CONTEXT, ContextBudget
from tokenpipe.control.traffic import TrafficControl
from tokenpipe.errors import GatewayError
from tokenpipe.front import schema
from tokenpipe.front.auth import Authenticator
from tokenpipe.observe import metrics
from tokenpipe.relay import SSERelay, StreamTally
from tokenpipe.router import Router
from tokenpipe.settings import Settings
from tokenpipe.upstream.http import read_bounded

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

SETTINGS: web.AppKey[Settings] = web.AppKey("settings", Settings)
ROUTER: web.AppKey[Router] = web.AppKey("router", Router)
AUTH: web.AppKey[Authenticator] = web.AppKey("auth", Authenticator)
STATE: web.AppKey[dict[str, Any]] = web.AppKey("state", dict)
TRAFFIC: web.AppKey[TrafficControl] = web.AppKey("traffic", TrafficControl)


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
    try:
        return await handler(request)
    except GatewayError as e:
        return error_response(e, request.get("request_id"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(GatewayError(e.status, e.reason), request.get("request_id"))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s", request.path)
        return error_response(GatewayError(500, "Internal error in the gateway."),
                              request.get("request_id"))


def _request_id(request: web.Request) -> str:
    rid = request.headers.get("x-request-id")
    if rid is None or not _REQUEST_ID.match(rid):
        rid = uuid.uuid4().hex
    request["request_id"] = rid
    return rid


async def _read_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        raise GatewayError(413, f"Request body of {length} bytes is over the limit of "
                           f"{limit} bytes.", code="request_too_large")
    parts: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"Request body is over the limit of {limit} bytes.",
                               code="request_too_large")
        parts.append(chunk)
    return b"".join(parts)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, schema.ChatRequest, "/chat/completions")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, schema.CompletionRequest, "/completions")


async def _completion(
    request: web.Request,
    kind: type[schema.ChatRequest] | type[schema.CompletionRequest],
    path: str,
) -> web.StreamResponse:
    started = time.perf_counter()
    app = request.app
    rid = _request_id(request)
    key = app[AUTH].check(request.headers.get("Authorization"))
    body = await _read_body(request, app[SETTINGS].server.max_body_bytes)
    req, obj = schema.parse(body, kind)
    ctx = await app[CONTEXT].apply(kind, req, obj, request.headers)  # may shorten the request
    body = ctx.body or body
    stream = bool(req.stream)
    strip_usage = False
    if stream:
        wants_usage = bool(req.stream_options and req.stream_options.include_usage)
        upstreams = await app[ROUTER].candidates(req.model)
        if not wants_usage and all(u.settings.request_usage for u in upstreams):
            opts = dict(obj.get("stream_options") or {})
            opts["include_usage"] = True
            obj["stream_options"] = opts
            body = orjson.dumps(obj)
            strip_usage = True
    # Per-key quota (429 when over; it needs the token count, so it follows the parse), then
    # the upstream limiter inside open(): waits for capacity, learns from the answer.
    ticket = await app[TRAFFIC].admit(key, obj)
    try:
        upstream, uresp = await app[ROUTER].open(req.model, path, body, rid, ticket)
    except BaseException:
        ticket.finish()
        raise
    tally = StreamTally(upstream.name, req.model, started)
    gauge = metrics.INFLIGHT.labels(upstream.name, req.model)
    gauge.inc()
    status = CLIENT_CLOSED
    try:
        if uresp.status != 200 or not stream:
            status, response = await _unary(uresp, tally, rid)
            response.headers.update(ctx.headers)
            return response
        sse_response = web.StreamResponse(
            status=200, headers={**_SSE_HEADERS, "x-request-id": rid, **ctx.headers}
        )
        await sse_response.prepare(request)
        status = await _relay_stream(uresp, sse_response, SSERelay(tally, strip_usage))
        return sse_response
    finally:
        uresp.close()  # at once: a client that went away must not keep the upstream busy
        gauge.dec()
        tally.finish(status)
        ticket.finish(tally.usage, status)
        ctx.observe(tally.usage)


async def _unary(
    uresp: aiohttp.ClientResponse, tally: StreamTally, rid: str
) -> tuple[int, web.Response]:
    """A non-streamed answer, or an upstream error before streaming: passed through as sent."""
    try:
        body = await read_bounded(uresp)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        raise GatewayError(502, "Upstream closed the connection before answering.",
                           code="upstream_error") from None
    headers = {"x-request-id": rid}
    status = uresp.status
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    if status == 200:
        if not isinstance(obj, dict):
            raise GatewayError(502, "Upstream sent a response that is not JSON.",
                               code="upstream_error")
        tally.usage = obj.get("usage")
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
        body = GatewayError(status, f"Upstream answered with status {uresp.status}.",
                            code="upstream_error").json()
    if status == 429 and "Retry-After" not in uresp.headers:
        headers.update(GatewayError(429, "").headers)
    return status, json_response(status, body, headers)


async def _relay_stream(
    uresp: aiohttp.ClientResponse, response: web.StreamResponse, relay: SSERelay
) -> int:
    """Returns the status to record. Errors after the first byte become an SSE error event."""
    tally = relay.tally
    error: GatewayError | None = None
    try:
        async for chunk in uresp.content.iter_any():
            out = relay.feed(chunk)
            if out:
                await response.write(out)
        if not tally.done:
            error = GatewayError(502, _cut_message(tally, "the upstream ended the stream early"),
                                 code="upstream_stream_truncated")
    except sse.SSEProtocolError as e:
        error = GatewayError(502, _cut_message(tally, str(e)), code="upstream_protocol_error")
    except asyncio.TimeoutError:
        error = GatewayError(504, _cut_message(tally, "the upstream stopped sending"),
                             code="upstream_timeout")
    except aiohttp.ClientPayloadError:
        error = GatewayError(502, _cut_message(tally, "the upstream connection broke"),
                             code="upstream_stream_truncated")
    except aiohttp.ClientConnectionError:
        error = GatewayError(502, _cut_message(tally, "the upstream connection broke"),
                             code="upstream_stream_truncated")
    except ConnectionResetError:
        return CLIENT_CLOSED
    if error is not None:
        try:
            await response.write(sse.encode(error.json()) + sse.DONE_EVENT)
        except ConnectionResetError:
            return CLIENT_CLOSED
        await response.write_eof()
        return error.status
    await response.write_eof()
    return 200


def _cut_message(tally: StreamTally, why: str) -> str:
    return (f"The stream was cut after {tally.chunks} content chunks: {why}. "
            "The answer is incomplete.")


async def list_models(request: web.Request) -> web.Response:
    _request_id(request)
    request.app[AUTH].check(request.headers.get("Authorization"))
    names = await request.app[ROUTER].models()
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "tokenpipe"} for n in names]
    return json_response(200, orjson.dumps({"object": "list", "data": data}))


async def metrics_endpoint(request: web.Request) -> web.Response:
    return web.Response(body=metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def healthz(request: web.Request) -> web.Response:
    return json_response(200, b'{"status":"ok"}')


async def readyz(request: web.Request) -> web.Response:
    if request.app[STATE].get("draining"):
        return json_response(503, GatewayError(503, "Draining: shutting down.",
                                               code="draining").json())
    return json_response(200, b'{"status":"ready"}')


def build_app(settings: Settings, router: Router) -> web.Application:
    app = web.Application(
        middlewares=[errors_middleware],
        # aiohttp's own cap, one byte over ours so that our 413 (OpenAI-shaped) answers first.
        client_max_size=settings.server.max_body_bytes + 1,
        handler_args={"max_field_size": 16384, "max_line_size": 16384},
    )
    app[SETTINGS] = settings
    app[ROUTER] = router
    app[AUTH] = Authenticator(settings.auth.api_keys)
    app[CONTEXT] = ContextBudget(settings.context, router)
    app[STATE] = {"draining": False}
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)

    async def close_router(app: web.Application) -> None:
        await router.close()

    app.on_cleanup.append(close_router)
    traffic = app[TRAFFIC] = TrafficControl(settings)

    async def start_traffic(app: web.Application) -> None:
        await traffic.start()

    async def close_traffic(app: web.Application) -> None:
        await traffic.close()

    app.on_startup.append(start_traffic)
    app.on_cleanup.append(close_traffic)
    return app
