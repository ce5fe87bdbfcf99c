"""`POST /v1/embeddings`: passed through to the upstream's /embeddings, with everything a
completion gets on its way (key quotas, the limiter charged the estimated input tokens,
retries, fallbacks, circuit breaking, metrics); never streamed."""

from __future__ import annotations

from tokenpipe.dialects import openai_schema as schema
from tokenpipe.dialects.embeddings import EMBEDDINGS, EmbeddingsRequest
from tokenpipe.front.answer import serve
from tokenpipe.front.edge import arrive
from tokenpipe.front.wire import Request, Response, StreamResponse


async def embeddings(request: Request) -> Response | StreamResponse:
    arrival = await arrive(request)
    req, obj = schema.parse(arrival.body, EmbeddingsRequest)
    return await serve(request, arrival, EmbeddingsRequest, req, obj, dialect=EMBEDDINGS)
