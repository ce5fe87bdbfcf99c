"""What the translations read of a chat upstream's answers (for a Messages or a Responses
client): its chunks and its completions, the fields they turn into their API's, and nothing
else (event_json.py).

The types are TypedDicts, so a decoded chunk is the same plain dict a whole parse gives,
holding only these keys: the translations read it with `.get` and type checks either way,
whether it came typed or, for one of another shape, `lenient`ly. Its lists are bounded
(MAX_ITEMS), since each entry is an object built: past the bound the answer is of another
shape.
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

import msgspec

from tokenpipe import answer_fields
from tokenpipe.dialects import event_json
from tokenpipe.dialects.event_json import MAX_ITEMS, NULL, lenient, not_json, object_of


class Function(TypedDict, total=False):
    name: str | None
    arguments: str | None


class ToolCall(TypedDict, total=False):
    index: int | None
    id: str | None
    function: Function | None


ToolCalls = Annotated[list[ToolCall], msgspec.Meta(max_length=MAX_ITEMS)]


class Delta(TypedDict, total=False):
    content: str | None
    reasoning_content: str | None
    reasoning: str | None
    tool_calls: ToolCalls | None


class Choice(TypedDict, total=False):
    delta: Delta | None
    finish_reason: str | None


class Chunk(TypedDict, total=False):
    id: str | None
    model: str | None
    choices: Annotated[list[Choice], msgspec.Meta(max_length=answer_fields.MAX_CHOICES)] | None
    usage: msgspec.Raw  # objects built only when small: event_json.object_of
    error: msgspec.Raw


#: A completion's message: the fields of a chunk's delta.
Message = Delta


class CompletionChoice(TypedDict, total=False):
    message: Message | None
    finish_reason: str | None


class Completion(TypedDict, total=False):
    id: str | None
    model: str | None
    choices: (
        Annotated[list[CompletionChoice], msgspec.Meta(max_length=answer_fields.MAX_CHOICES)] | None
    )
    usage: msgspec.Raw


_decode = msgspec.json.Decoder(Chunk).decode
_decode_completion = msgspec.json.Decoder(Completion).decode


def read_chunk(data: bytes) -> dict[str, Any]:
    """The chunk's fields the translations read; `usage` and `error` as objects or None.
    Raises sse.SSEProtocolError when it is not JSON, not an object, or (over
    event_json.MAX_LENIENT_BYTES) not of this shape."""
    # (event_json.answer's steps, written out: this runs per token, and a call is ~1%.)
    try:
        obj: dict[str, Any] = _decode(data)  # type: ignore[assignment]  # (a TypedDict)
    except msgspec.ValidationError:
        return lenient(data)
    except (msgspec.DecodeError, RecursionError):
        raise not_json() from None
    if "usage" in obj:  # (`null` in every chunk: the gateway asks for the usage)
        obj["usage"] = None if obj["usage"] == NULL else object_of(obj["usage"])
    if "error" in obj:
        obj["error"] = object_of(obj["error"])
    return obj


def lone_text(obj: dict[str, Any]) -> str | None:
    """The text of a chunk read by `read_chunk` that is one text delta and nothing else (no
    usage, error, finish, role-only, reasoning or tool call: what a token's chunk is); None
    for any other shape. A translation writes such a chunk's event on a short path of its own.
    The decoded chunk holds only the fields read (a delta's role is not one of them), so a
    delta of one key is the content alone; a `lenient` read's may hold anything."""
    choices = obj.get("choices")
    if type(choices) is not list or len(choices) != 1:
        return None
    if obj.get("usage") is not None or obj.get("error") is not None:
        return None
    first = choices[0]
    delta = first.get("delta") if type(first) is dict else None
    if type(delta) is not dict or len(delta) != 1 or first.get("finish_reason") is not None:
        return None
    text = delta.get("content")
    return text if type(text) is str and text else None


def read_completion(body: bytes) -> dict[str, Any] | None:
    """A chat completion's fields the translations read (`usage` as an object or None);
    None when it is not JSON (see event_json.answer)."""
    obj = event_json.answer(_decode_completion, body)
    if obj is not None and isinstance(raw := obj.get("usage"), msgspec.Raw):
        obj["usage"] = object_of(raw)
    return obj
