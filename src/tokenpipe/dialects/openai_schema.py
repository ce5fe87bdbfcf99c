"""Validation of client requests against the parts of the OpenAI schema the gateway relies on.

Only what we read is typed; every other field is left as the client sent it and forwarded
untouched (the gateway rewrites nothing the client did not ask to change). msgspec checks a
request in microseconds and names the offending field in its message.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import orjson
from msgspec import Meta, Struct

from tokenpipe.errors import VALIDATION_FIELD, GatewayError, validation_field

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
Temperature = Annotated[float, Meta(ge=0, le=2)]
Probability = Annotated[float, Meta(ge=0, le=1)]
TokenCount = Annotated[int, Meta(ge=1)]
#: Messages per chat request: bounds the per-request work of validating and counting
#: (100,000 messages took 1 s to count); far above real conversations. Over it: a 400.
MAX_MESSAGES = 10_000
#: Characters of a model name: longer than any provider's (a Bedrock inference profile's ARN
#: is ~110). Unbounded, one name could be most of a 4 MiB body, and a name is kept (the
#: window lookup's cache, latency estimators), logged and traced: 200 such names held 430
#: MB. Over it: a 400 naming `model`.
MAX_MODEL_NAME = 256
ModelName = Annotated[str, Meta(min_length=1, max_length=MAX_MODEL_NAME)]


#: Bodies from this size are parsed with the cyclic collector paused. A parse makes no cycles,
#: so the collector has nothing to find in it, but every 10,000 containers it makes start a
#: young collection, and the full ones walk the growing tree: 4 MiB of `[]` in an unread
#: field took 169 ms to parse and free, 109 paused (the orjson step alone: 133 and 76 ms;
#: benchmarks/hostile_cost.py --case body). A smaller body makes too few to start one.
GC_PAUSE_BYTES = 64 * 1024


class Object(Struct, gc=False):
    """Any JSON object, its fields unread (tools, tool_choice, metadata, Responses items):
    passed on as sent. Checked as a Struct, not as `dict[str, Any]`: msgspec copies a dict it
    converts, and the copy was thrown away (4 MiB of `{}`: 1.4 M copies, ~80 ms)."""


class ContentPart(Struct, gc=False):
    """A content part (text, image_url, input_audio, file, refusal): its `type` is required,
    as OpenAI's API requires it; the rest is passed on as sent, unread."""

    type: str


class Message(Struct):
    role: Role
    content: str | list[ContentPart] | None = None


class StreamOptions(Struct):
    include_usage: bool | None = None
    #: tokenpipe extension: the rate (tokens/s) the client can render; the relay paces to it.
    max_tokens_per_second: Annotated[float, Meta(ge=0, le=1e6)] | None = None


class ChatRequest(Struct):
    model: ModelName
    messages: Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    n: Annotated[int, Meta(ge=1, le=128)] | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None


# OpenAI allows a string, strings, token ids or lists of token ids (msgspec takes one list type).
Prompt = str | list[str | int | list[int]]


class CompletionRequest(Struct):
    model: ModelName
    prompt: Prompt
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=0)] | None = None
    n: Annotated[int, Meta(ge=1, le=128)] | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None


T = TypeVar("T")


def prepare(*kinds: type[Any]) -> None:
    """Has msgspec build each request type's validator now. It builds one on the type's first
    use, evaluating the annotations of the type and of every type under it (typing's
    `_eval_type`): 0.45 ms for ChatRequest, in a new process's first chat request (its edge
    phase: 0.81 ms against 0.09 warm, benchmarks/first_request.py)."""
    for kind in kinds:
        with contextlib.suppress(msgspec.ValidationError):
            msgspec.convert({}, kind)


def parse(body: bytes, kind: type[Any]) -> tuple[Any, dict]:
    """Returns (typed request, the JSON object as sent). Raises a 400 GatewayError."""
    paused = len(body) >= GC_PAUSE_BYTES and gc.isenabled()
    if paused:
        gc.disable()
    try:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise GatewayError(
                400, f"We could not parse the JSON body of your request: {e}", code="invalid_json"
            ) from None
        if not isinstance(obj, dict):
            raise GatewayError(400, "The request body must be a JSON object.", code="invalid_json")
        try:
            return msgspec.convert(obj, kind), obj
        except msgspec.ValidationError as e:
            text = str(e)
            param = validation_field(text)
            message = VALIDATION_FIELD.sub("", text) + (f" (at '{param}')" if param else "")
            raise GatewayError(
                400, f"Invalid request: {message}", param=param, code="invalid_request"
            ) from None
    finally:
        if paused:
            gc.enable()
