"""The HTTP front: OpenAI-compatible routes on the front's own HTTP/1.1 server
(front/server.py; Anthropic's Messages routes are front/messages.py's, installed here).

Order of work per request: request id, auth, body size, parse and validate, route, relay.
Client mistakes are 4xx with an error body of the route's API (OpenAI's unless the route says
otherwise); nothing here returns a stack trace.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from importlib import resources
from typing import Any

from tokenpipe.control.pacing import pace_gate
from tokenpipe.dialects import openai_schema as schema
from tokenpipe.dialects.anthropic_schema import CountTokensRequest, MessagesRequest
from tokenpipe.dialects.embeddings import EmbeddingsRequest
from tokenpipe.dialects.responses_request import ResponsesRequest
from tokenpipe.errors import GatewayError
from tokenpipe.front import cors, drain, messages, models
from tokenpipe.front.answer import serve
from tokenpipe.front.app import Front
from tokenpipe.front.edge import CLIENT_CLOSED, arrive, error_response, request_id
from tokenpipe.front.embeddings import embeddings
from tokenpipe.front.listener import Server
from tokenpipe.front.responses import responses
from tokenpipe.front.wire import Request, Response, StreamResponse, json_response
from tokenpipe.observe import logs, metrics, tracing
from tokenpipe.pipeline import Gateway

#: What the routes validate bodies as (schema.prepare'd when the front is built).
REQUEST_TYPES = (
    schema.ChatRequest,
    schema.CompletionRequest,
    MessagesRequest,
    CountTokensRequest,
    ResponsesRequest,
    EmbeddingsRequest,
)

log = logging.getLogger("tokenpipe.front")


async def dispatch(request: Request) -> Response | StreamResponse:
    """Routes a request and answers every error as JSON in the route's API's shape (OpenAI's
    unless the route registered another): ours, routing's (404/405), or a bug's. With
    tracing on, an API request's server span opens here and ends with the status sent."""
    front: Front = request.app
    # Log lines written while serving this request carry its id (observe/logs.py).
    rid = request_id(request)
    token = logs.REQUEST_ID.set(rid)
    api = request.path.startswith("/v1/")
    found = front.route(request.path)
    trace = None
    if tracing.TRACER is not None and api:
        trace = _server_span(request, rid, found[0] if found is not None else None)
        trace_token = tracing.CURRENT.set(trace)
    response: Response | StreamResponse | None = None
    try:
        try:
            if front.cors is not None and cors.is_preflight(request):
                response = cors.preflight(front, request)
                return response
            if found is None:
                raise _not_found(front, request)
            methods = found[1]
            handler = methods.get(request.method)
            if handler is None and request.method == "HEAD":
                handler = methods.get("GET")
            if handler is None:
                raise _not_allowed(request, methods)
            if api:
                response = await drain.tracked(
                    front.drain, front.gateway.draining, request, handler
                )
            else:
                response = await handler(request)
        except GatewayError as e:
            response = error_response(e, request.rid, front.error_body(request), request.timing)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("internal error on %s", _safe_path(request))
            response = error_response(
                GatewayError(500, "Internal error in the gateway."),
                request.rid,
                front.error_body(request),
                request.timing,
            )
        return response
    finally:
        if request.held:  # its body's charge (edge.arrive), its stream over
            front.gateway.bodies.give(request.held)
            request.held = 0
        if trace is not None:  # no response: the client went away
            trace.close(response.status if response is not None else CLIENT_CLOSED)
            tracing.CURRENT.reset(trace_token)
        logs.REQUEST_ID.reset(token)


def _server_span(request: Request, rid: str, template: str | None) -> tracing.RequestTrace:
    """The request's SERVER span, continuing the client's traceparent, named as the HTTP
    conventions say (the route's template; the method alone for an unknown route)."""

    def span() -> tuple[str, dict[str, Any]]:
        attributes = {
            "http.request.method": request.method,
            "url.path": _safe_path(request),
            "url.scheme": "http",
            "tokenpipe.request_id": rid,
        }
        if template is None:
            return request.method, attributes
        attributes["http.route"] = template
        return f"{request.method} {template}", attributes

    return tracing.serve(request.headers, span)


def _not_allowed(request: Request, methods: Mapping[str, object]) -> GatewayError:
    """A 405 a client can act on: what is allowed."""
    allowed = ", ".join(sorted({*methods, *(["HEAD"] if "GET" in methods else [])}))
    return GatewayError(
        405,
        f"{request.method} is not allowed on {_safe_path(request)}; use {allowed}.",
        code="method_not_allowed",
        headers={"Allow": allowed},
    )


def _not_found(front: Front, request: Request) -> GatewayError:
    """A 404 a client can act on: what is served."""
    return GatewayError(
        404,
        f"The gateway does not serve {request.method} {_safe_path(request)}. "
        f"It serves: {front.served()}.",
        code="unknown_route",
    )


def _safe_path(request: Request) -> str:
    """The path as the client sent it, bounded and with keys masked: it is echoed back."""
    return logs.redact(request.path[:200])


async def chat_completions(request: Request) -> Response | StreamResponse:
    return await _completion(request, schema.ChatRequest)


async def completions(request: Request) -> Response | StreamResponse:
    return await _completion(request, schema.CompletionRequest)


async def _completion(
    request: Request,
    kind: type[schema.ChatRequest] | type[schema.CompletionRequest],
) -> Response | StreamResponse:
    arrival = await arrive(request)
    req, obj = schema.parse(arrival.body, kind)
    gate = None
    if req.stream:
        gate = pace_gate(
            request.headers,
            req.stream_options.max_tokens_per_second if req.stream_options else None,
        )
    return await serve(request, arrival, kind, req, obj, stream=bool(req.stream), gate=gate)


async def metrics_endpoint(request: Request) -> Response:
    text = await metrics.render_async()
    return Response(200, text, content_type="text/plain; version=0.0.4; charset=utf-8")


async def healthz(request: Request) -> Response:
    return json_response(200, b'{"status":"ok"}')


async def readyz(request: Request) -> Response:
    if request.app.gateway.draining:
        return json_response(
            503, GatewayError(503, "Draining: shutting down.", code="draining").json()
        )
    return json_response(200, b'{"status":"ready"}')


async def openapi(request: Request) -> Response:
    """The gateway's own OpenAPI description (front/openapi.json, shipped as package data)."""
    global _OPENAPI
    if _OPENAPI is None:
        _OPENAPI = (resources.files("tokenpipe.front") / "openapi.json").read_bytes()
    return json_response(200, _OPENAPI)


_OPENAPI: bytes | None = None


def build(
    gateway: Gateway,
    *,
    idle_seconds: float = 75.0,
    keepalive_seconds: float = 75.0,
    access: bool = False,
) -> tuple[Front, Server]:
    """The front's routes and the server that serves them. `idle_seconds`: a request's head
    must have all arrived this long after it began, or after the connection opened
    (slowloris). `keepalive_seconds`: an idle kept-alive connection is closed after this
    long. `access`: one log line per request."""
    front = Front(gateway)
    schema.prepare(*REQUEST_TYPES)  # not on each type's first request
    front.add("POST", "/v1/chat/completions", chat_completions)
    front.add("POST", "/v1/completions", completions)
    messages.install(front)  # /v1/messages, /v1/messages/count_tokens (Anthropic's API)
    front.add("POST", "/v1/responses", responses)
    front.add("POST", "/v1/embeddings", embeddings)
    models.install(front)  # GET /v1/models, in OpenAI's shape or Anthropic's
    front.add("GET", "/metrics", metrics_endpoint)
    front.add("GET", "/healthz", healthz)
    front.add("GET", "/readyz", readyz)
    front.add("GET", "/openapi.json", openapi)
    cors.install(front, gateway.settings.server.cors_origins)
    server = Server(
        front,
        dispatch,
        idle_seconds=idle_seconds,
        keepalive_seconds=keepalive_seconds,
        access=_access if access else None,
        decorate=(lambda r, h: cors.add_headers(front, r, h)) if front.cors else None,
    )
    return front, server


def _access(request: Request, status: int, seconds: float) -> None:
    """One structured record per request on `tokenpipe.access`."""
    if not logs.ACCESS.isEnabledFor(logging.INFO):
        return
    path = _safe_path(request)
    method = request.method
    logs.access(
        f"{method} {path} {status} {seconds * 1000:.1f} ms",
        {
            "request_id": request.rid,
            "method": method,
            "path": path,
            "status": status,
            "duration_ms": round(seconds * 1000, 3),
        },
    )
