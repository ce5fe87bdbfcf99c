"""`GET /v1/models`: the models the upstreams serve, in the shape of the client's API;
`GET /v1/models/{model}`: one of them (the SDKs' `models.retrieve`), or a 404 when the list
does not have it.

OpenAI's clients get `{"object": "list", "data": [{"id", "object": "model", ...}]}`. A request
that carries `anthropic-version` (Anthropic's SDKs always send it) is an Anthropic client's:
it gets Anthropic's list (`{"data": [{"type": "model", "id", "display_name", "created_at",
...}], "has_more", "first_id", "last_id"}`, paged by `limit`, `after_id` and `before_id`), its
key may come as `x-api-key`, and its errors are in Anthropic's shape, as on /v1/messages.
The gateway knows a model's name only: it is the display name too, and `created_at` is the
Unix epoch (OpenAI's `created` is 0 alike).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence

import orjson

from tokenpipe.dialects.anthropic import error_json
from tokenpipe.errors import GatewayError
from tokenpipe.front.app import Front
from tokenpipe.front.edge import request_id
from tokenpipe.front.wire import Request, Response, json_response

MODELS_PATH = "/v1/models"
MODEL_PATH = "/v1/models/{model}"
_MODEL_PREFIX = MODELS_PATH + "/"
#: The header by which a request says it is an Anthropic client's.
ANTHROPIC_VERSION = "anthropic-version"
#: Anthropic's page size: the default and the bounds of `limit`.
DEFAULT_LIMIT = 20
MAX_LIMIT = 1000
#: `created_at` of every model: the gateway has no release date (RFC 3339, UTC).
_EPOCH = "1970-01-01T00:00:00Z"


def _anthropic_client(request: Request) -> bool:
    """Checks the key (an Anthropic client's may come as `x-api-key`); whether the request
    is an Anthropic client's."""
    request_id(request)
    headers = request.headers
    auth = request.app.gateway.auth
    if ANTHROPIC_VERSION in headers:
        auth.check_any(headers.get("Authorization"), headers.get("x-api-key"))
        return True
    auth.check(headers.get("Authorization"))
    return False


async def list_models(request: Request) -> Response:
    anthropic = _anthropic_client(request)
    listing = await request.app.gateway.router.models()
    if anthropic:  # a page: at most MAX_LIMIT models, found by bisection
        return json_response(200, orjson.dumps(anthropic_page(listing.names, request.query)))
    # The whole list, rendered once per change of an upstream's list (router.candidates).
    if listing.body is None:
        data = [_openai_model(n) for n in listing.names]
        listing.body = orjson.dumps({"object": "list", "data": data})
    return json_response(200, listing.body)


async def retrieve_model(request: Request) -> Response:
    """One model, in the client's API's shape; a model is there when the list has it."""
    anthropic = _anthropic_client(request)
    model = request.path[len(_MODEL_PREFIX) :]
    if model not in (await request.app.gateway.router.models()).known:
        raise GatewayError(
            404,
            f"The model `{model[:200]}` does not exist or you do not have access to it.",
            code="model_not_found",
            param="model",
        )
    body = _anthropic_model(model) if anthropic else _openai_model(model)
    return json_response(200, orjson.dumps(body))


def _openai_model(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tokenpipe"}


def _anthropic_model(name: str) -> dict[str, object]:
    return {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": _EPOCH,
        "lifecycle": "active",
    }


def anthropic_page(names: Sequence[str], query: Mapping[str, str]) -> dict[str, object]:
    """One page of Anthropic's list of `names` (sorted). The cursors are positions in that
    order: `after_id` pages forward from a name, `before_id` back; either may name a model
    that is no longer listed. `has_more`: more lie beyond the page in its direction."""
    limit = _limit(query.get("limit"))
    after, before = query.get("after_id"), query.get("before_id")
    if after is not None and before is not None:
        raise GatewayError(400, "Use either after_id or before_id, not both.", param="after_id")
    if before is not None:
        end = bisect_left(names, before)  # names[:end] < before
        page = names[max(0, end - limit) : end]
        has_more = end > limit
    else:
        start = 0 if after is None else bisect_right(names, after)  # names[start:] > after
        page = names[start : start + limit]
        has_more = len(names) - start > limit
    return {
        "data": [_anthropic_model(n) for n in page],
        "has_more": has_more,
        "first_id": page[0] if page else None,
        "last_id": page[-1] if page else None,
    }


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise GatewayError(400, f"limit must be an integer from 1 to {MAX_LIMIT}.", param="limit")
    return limit


def install(front: Front) -> None:
    """Adds the routes; their errors take Anthropic's shape for an Anthropic client's request."""
    front.add("GET", MODELS_PATH, list_models)
    front.add("GET", MODEL_PATH, retrieve_model)
    for path in (MODELS_PATH, MODEL_PATH):
        front.header_error_bodies[path] = (ANTHROPIC_VERSION, error_json)
