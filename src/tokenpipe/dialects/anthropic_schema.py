"""Validation of Anthropic Messages requests: the parts of the schema the gateway relies on.

As for OpenAI's (openai_schema.py), only what the gateway reads or what Anthropic's API would
refuse anyway for its type is typed; every other field (thinking, service_tier, container,
cache_control inside blocks, fields newer than this file) is left as the client sent it, and
a native request's bytes go upstream unchanged. A missing or mistyped field is a 400 naming
it (the route writes it in Anthropic's error shape).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from msgspec import Meta, Struct

from tokenpipe.dialects.openai_schema import MAX_MESSAGES, ModelName, Object, parse

__all__ = ["CountTokensRequest", "MessagesRequest", "parse"]


class Block(Struct, gc=False):
    """A content block (`{"type": "text", "text": ...}`, images, tool_use, tool_result, ...):
    its `type` is required, as Anthropic's API requires it; passed through whole, never read
    by the gateway (a Struct: see openai_schema.Object)."""

    type: str


class Message(Struct):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class MessagesRequest(Struct):
    """POST /v1/messages."""

    model: ModelName
    max_tokens: Annotated[int, Meta(ge=1)]
    messages: Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]
    stream: bool | None = None
    system: str | list[Block] | None = None
    tools: list[Object] | None = None
    tool_choice: Object | None = None
    metadata: Object | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None


class CountTokensRequest(Struct):
    """POST /v1/messages/count_tokens: the request without max_tokens; never streamed."""

    #: Not a field (a client's `stream` is passed on, not read): the pipeline asks for it.
    stream: ClassVar[bool] = False
    model: ModelName
    messages: Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[Block] | None = None
    tools: list[Object] | None = None
    tool_choice: Object | None = None
