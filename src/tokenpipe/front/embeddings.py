"""`POST /v1/embeddings`: passed through to the upstream's /embeddings, with everything a
completion gets on its way (key quotas, the limiter charged the estimated input tokens,
retries, fallbacks, circuit breaking, metrics); never streamed."""

from __future__ import annotations

import time

from aiohttp import web

from tokenpipe.dialects import openai_schema as schema
from tokenpipe.dialects.embeddings import EMBEDDINGS, EmbeddingsRequest
from tokenpipe.front.edge import GATEWAY, read_body, request_id
from tokenpipe.front.responses import answer


async def embeddings(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    gw = request.app[GATEWAY]
    rid = request_id(request)
    key = gw.auth.check(request.headers.get("Authorization"))
    scope = gw.scope(request.headers)
    server = gw.settings.server
    body = await read_body(request, server.max_body_bytes, server.read_timeout_seconds)
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
    )
    return await answer(request, call, rid, False, None)
