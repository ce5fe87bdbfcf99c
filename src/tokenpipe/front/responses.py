"""`POST /v1/responses`: the OpenAI Responses API, streamed or not.

Which way a request goes is the upstreams' setting (`upstreams[].responses`): passed through
to /responses when every upstream that serves the model has it (`native`, or `auto`, the
default, and the upstream's answer to one probe said so: upstream/responses_probe.py), else
translated into a chat completion (llama.cpp, the embedded model and most OpenAI-compatible
servers have no Responses API), whose answer or stream is translated back
(dialects/responses_chat.py). Translated requests are chat requests below this point, so
context budgeting applies to them as to chat.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenpipe.control.pacing import pace_gate
from tokenpipe.dialects import openai_schema as schema
from tokenpipe.dialects.base import Dialect
from tokenpipe.dialects.responses import ResponsesDialect
from tokenpipe.dialects.responses_chat import ResponsesViaChat
from tokenpipe.dialects.responses_request import ResponsesRequest, to_chat
from tokenpipe.errors import GatewayError, dumps_request
from tokenpipe.front.answer import serve
from tokenpipe.front.edge import arrive
from tokenpipe.front.wire import Request, Response, StreamResponse
from tokenpipe.pipeline import Gateway


async def responses(request: Request) -> Response | StreamResponse:
    arrival = await arrive(request)
    body = arrival.body
    req, obj = schema.parse(body, ResponsesRequest)
    gate = None
    if req.stream:
        opts = req.stream_options
        gate = pace_gate(request.headers, opts.max_tokens_per_second if opts else None)
    kind: type[Any] = ResponsesRequest
    dialect: Dialect
    if await _native(arrival.gateway, req.model, arrival.scope.left()):
        dialect = ResponsesDialect()  # per request: it numbers the gateway's own error event
    else:
        dialect = ResponsesViaChat(obj)
        obj = to_chat(obj)
        try:
            req = msgspec.convert(obj, schema.ChatRequest)
        except msgspec.ValidationError as e:  # what the translation let through, chat refuses
            raise GatewayError(400, f"Invalid request: {e}", code="invalid_request") from None
        body, kind = dumps_request(obj), schema.ChatRequest
    return await serve(
        request,
        arrival,
        kind,
        req,
        obj,
        stream=bool(req.stream),
        gate=gate,
        dialect=dialect,
        body=body,
    )


async def _native(gw: Gateway, model: str, limit: float) -> bool:
    """Every upstream that serves `model` serves /responses itself (a fallback to one that
    does not would fail a native request: then all of them get chat). An `auto` upstream not
    yet asked is asked here, waiting at most `limit` seconds (the request's scope)."""
    for u in await gw.router.candidates(model, "openai"):
        native = u.serves_responses_now()  # known, almost always: no coroutine then
        if native is None:
            native = await u.serves_responses(limit)
        if not native:
            return False
    return True
