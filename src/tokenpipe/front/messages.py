"""The Anthropic Messages routes: `POST /v1/messages` (streamed or not) and
`POST /v1/messages/count_tokens`, for Anthropic's clients.

Native: a Messages request goes to the upstreams with `api: anthropic` only, its bytes
unchanged, through the same request path as chat (deadline scope, admission, limiter, retries,
hedging, stall deadlines, disconnect cancel, metrics). The client's key may come as `x-api-key`
(what Anthropic's SDKs send) or `Authorization: Bearer`; the upstream gets the config's key and
`anthropic-version`, never the client's headers. Every error on these routes, from the edge
or from below, is Anthropic's `{"type": "error", "error": {"type", "message"}}` with its
status. Context budgeting does not apply (yet): it knows OpenAI's request shapes only.
"""

from __future__ import annotations

from tokenpipe.control.pacing import pace_gate
from tokenpipe.dialects import COUNT_TOKENS, MESSAGES, Dialect
from tokenpipe.dialects import anthropic_schema as schema
from tokenpipe.front.answer import serve
from tokenpipe.front.app import Front
from tokenpipe.front.edge import arrive
from tokenpipe.front.wire import Request, Response, StreamResponse

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


async def messages(request: Request) -> Response | StreamResponse:
    return await _messages(request, schema.MessagesRequest, MESSAGES)


async def count_tokens(request: Request) -> Response | StreamResponse:
    """A non-streamed passthrough to the upstream's /messages/count_tokens (it costs no
    tokens: COUNT_TOKENS returns the reservation)."""
    return await _messages(request, schema.CountTokensRequest, COUNT_TOKENS)


async def _messages(
    request: Request,
    kind: type[schema.MessagesRequest] | type[schema.CountTokensRequest],
    dialect: Dialect,
) -> Response | StreamResponse:
    arrival = await arrive(request, x_api_key=True)
    req, obj = schema.parse(arrival.body, kind)
    gate = pace_gate(request.headers, None) if req.stream else None
    # `kind` is not one of the OpenAI schemas: no context budgeting.
    return await serve(
        request, arrival, kind, req, obj, stream=bool(req.stream), gate=gate, dialect=dialect
    )


def install(front: Front) -> None:
    """Adds the routes, with Anthropic's error shape on both (Front.error_bodies)."""
    front.add("POST", MESSAGES_PATH, messages)
    front.add("POST", COUNT_TOKENS_PATH, count_tokens)
    for path in (MESSAGES_PATH, COUNT_TOKENS_PATH):
        front.error_bodies[path] = MESSAGES.error_body
