"""OpenAI's embeddings: one JSON answer, never streamed, passed through as the upstream sent
it. It generates no tokens: admission charges the input only (`output = False`), and the
answer's `usage` ({prompt_tokens, total_tokens}) is already in the shape the gateway counts."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from tokenpipe.dialects.base import Dialect, Piece
from tokenpipe.dialects.openai_schema import ModelName

#: Inputs per request (OpenAI's own limit is 2048): bounds the work of estimating their cost.
MAX_INPUTS = 2048


class EmbeddingsRequest(Struct):
    """The fields of an embeddings request the gateway reads (the rest is left as sent)."""

    model: ModelName
    # A string, strings, token ids or lists of token ids (msgspec takes one list type).
    input: str | Annotated[list[str | int | list[int]], Meta(min_length=1, max_length=MAX_INPUTS)]
    #: Never streamed (`stream` is not a field of the API: any value but null is refused).
    stream: None = None


class EmbeddingsDialect(Dialect):
    name = "embeddings"
    api = "openai"
    path = "/embeddings"
    output = False

    def read(
        self, data: bytes, event: str | None, raw: bytes | None, strip_usage: bool
    ) -> Piece | None:
        raise NotImplementedError("embeddings are never streamed")

    def answer(self, body: bytes, obj: dict[str, Any]) -> bytes:
        return body


EMBEDDINGS = EmbeddingsDialect()
