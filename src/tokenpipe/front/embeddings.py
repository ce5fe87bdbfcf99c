"""`POST /v1/embeddings`: passed through to the upstream's /embeddings, with everything a
completion gets on its way (key quotas, the limiter charged the estimated input tokens,
retries, fallbacks, circuit breaking, metrics); never streamed."""

from __future__ import annotations

from aiohttp import web

from tokenpipe.dialects import openai_schema as schema
from tokenpipe.dialects.embeddings import EMBEDDINGS, EmbeddingsRequest
from tokenpipe.front.answer import respond
from tokenpipe.front.edge import arrive, timing_of


async def embeddings(request: web.Request) -> web.StreamResponse:
    started, gw, rid, key, scope, body = await arrive(request)
    req, obj = schema.parse(body, EmbeddingsRequest)
    call = await gw.open(
        EmbeddingsRequest,
        req,
        obj,
        body,
        key=key,
        request_id=rid,
        started=started,
        headers=request.headers,
        scope=scope,
        dialect=EMBEDDINGS,
        timing=timing_of(request),
    )
    return await respond(request, call, rid, False, None)
