"""The HTTP front: OpenAI-compatible routes over aiohttp (Anthropic's Messages routes are
front/messages.py's, installed here).

Order of work per request: request id, auth, body size, parse and validate, route, relay.
Client mistakes are 4xx with an error body of the route's API (OpenAI's unless the route says
otherwise); nothing here returns a stack trace.
"""

from __future__ import annotations

import asyncio
import logging
from importlib import resources
from typing import Any

from aiohttp import web

from tokenpipe.control.pacing import pace_gate
from tokenpipe.dialects import openai_schema as schema
from tokenpipe.errors import GatewayError
from tokenpipe.front import cors, drain, messages, models
from tokenpipe.front.answer import serve
from tokenpipe.front.edge import (
    CLIENT_CLOSED,
    GATEWAY,
    arrive,
    error_body_of,
    error_response,
    json_response,
    request_id,
    timing_of,
)
from tokenpipe.front.embeddings import embeddings
from tokenpipe.front.responses import responses
from tokenpipe.observe import logs, metrics, tracing
from tokenpipe.observe.runtime import RuntimeSampler
from tokenpipe.pipeline import Gateway

log = logging.getLogger("tokenpipe.front")

DRAIN: web.AppKey[drain.Drain] = web.AppKey("drain", drain.Drain)


@web.middleware
async def errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error leaves as JSON in the route's API's shape (OpenAI's unless the route
    registered another in ERROR_BODIES): ours, aiohttp's (404/405/413), or a bug's. With
    tracing on, an API request's server span opens here and ends with the status sent."""
    # Log lines written while serving this request carry its id (observe/logs.py).
    rid = request_id(request)
    token = logs.REQUEST_ID.set(rid)
    trace = None
    if tracing.TRACER is not None and request.path.startswith("/v1/"):
        trace = _server_span(request, rid)
        trace_token = tracing.CURRENT.set(trace)
    response: web.StreamResponse | None = None
    try:
        try:
            response = await handler(request)
        except GatewayError as e:
            response = error_response(
                e, request.get("request_id"), error_body_of(request), timing_of(request)
            )
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = error_response(
                _routing_error(request, e),
                request.get("request_id"),
                error_body_of(request),
                timing_of(request),
            )
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("internal error on %s", request.path)
            response = error_response(
                GatewayError(500, "Internal error in the gateway."),
                request.get("request_id"),
                error_body_of(request),
                timing_of(request),
            )
        return response
    finally:
        if trace is not None:  # no response: the client went away
            trace.close(response.status if response is not None else CLIENT_CLOSED)
            tracing.CURRENT.reset(trace_token)
        logs.REQUEST_ID.reset(token)


def _server_span(request: web.Request, rid: str) -> tracing.RequestTrace:
    """The request's SERVER span, continuing the client's traceparent, named as the HTTP
    conventions say (the route's template; the method alone for an unknown route)."""
    resource = request.match_info.route.resource
    attributes = {
        "http.request.method": request.method,
        "url.path": _safe_path(request),
        "url.scheme": request.scheme,
        "tokenpipe.request_id": rid,
    }
    name = request.method
    if resource is not None:
        attributes["http.route"] = resource.canonical
        name = f"{request.method} {resource.canonical}"
    return tracing.serve(name, request.headers, attributes)


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


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, schema.ChatRequest)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, schema.CompletionRequest)


async def _completion(
    request: web.Request,
    kind: type[schema.ChatRequest] | type[schema.CompletionRequest],
) -> web.StreamResponse:
    arrival = await arrive(request)
    req, obj = schema.parse(arrival.body, kind)
    gate = None
    if req.stream:
        gate = pace_gate(
            request.headers,
            req.stream_options.max_tokens_per_second if req.stream_options else None,
        )
    return await serve(request, arrival, kind, req, obj, stream=bool(req.stream), gate=gate)


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
    messages.install(app)  # /v1/messages, /v1/messages/count_tokens (Anthropic's API)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/embeddings", embeddings)
    models.install(app)  # GET /v1/models, in OpenAI's shape or Anthropic's
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
