"""A chat chunk as the translations read it (a chat upstream serving a Messages or a Responses
client): the fields they turn into their API's events, and nothing else (event_json.py).

The types are TypedDicts, so a decoded chunk is the same plain dict a whole parse gives,
holding only these keys: the translations read it with `.get` and type checks either way,
whether it came typed or, for a chunk of another shape, `lenient`ly.
"""

from __future__ import annotations

from typing import Any, TypedDict

import msgspec

from tokenpipe.dialects.event_json import lenient, not_json, object_of


class Function(TypedDict, total=False):
    name: str | None
    arguments: str | None


class ToolCall(TypedDict, total=False):
    index: int | None
    id: str | None
    function: Function | None


class Delta(TypedDict, total=False):
    content: str | None
    reasoning_content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall] | None


class Choice(TypedDict, total=False):
    delta: Delta | None
    finish_reason: str | None


class Chunk(TypedDict, total=False):
    id: str | None
    model: str | None
    choices: list[Choice] | None
    usage: msgspec.Raw  # objects built only when small: event_json.object_of
    error: msgspec.Raw


_decode = msgspec.json.Decoder(Chunk).decode


def read_chunk(data: bytes) -> dict[str, Any]:
    """The chunk's fields the translations read; `usage` and `error` as objects or None.
    Raises sse.SSEProtocolError when it is not JSON, not an object, or (over
    event_json.MAX_LENIENT_BYTES) not of this shape."""
    try:
        obj: dict[str, Any] = _decode(data)  # type: ignore[assignment]  # (a TypedDict)
    except msgspec.ValidationError:
        return lenient(data)
    except (msgspec.DecodeError, RecursionError):
        raise not_json() from None
    if "usage" in obj:
        obj["usage"] = object_of(obj["usage"])
    if "error" in obj:
        obj["error"] = object_of(obj["error"])
    return obj
