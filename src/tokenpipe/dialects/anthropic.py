"""Anthropic's Messages stream: `event: NAME` + `data: {"type": NAME, ...}` events.

message_start (usage: input and cache tokens), content_block_start, content_block_delta
(text_delta, input_json_delta, thinking_delta, signature_delta, citations_delta),
content_block_stop, message_delta (stop_reason, cumulative usage), message_stop (the last
event), ping, error. Only the fields the gateway acts on are decoded (msgspec, typed); an event
whose shape the typed decode refuses is judged on its dict, and passed on as it came either
way. Every event leaves with its `event:` line: the official SDKs dispatch on it and drop an
event without one.

Native only (an Anthropic client on an `api: anthropic` upstream): request and answer bytes
pass unchanged; translation between APIs is a later dialect.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from tokenpipe import sse
from tokenpipe.dialects.base import Dialect, Piece
from tokenpipe.dialects.event_json import ABSENT, lenient, object_of, raw_object
from tokenpipe.errors import GatewayError
from tokenpipe.usage import MAX_COUNT

#: status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_json(error: GatewayError) -> bytes:
    """`{"type": "error", "error": {"type", "message"}}`: Anthropic's error body."""
    kind = ERROR_TYPES.get(error.status, "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": error.message}})


# The fields of an event the relay acts on (event_json.py: what is Raw and why); one struct
# for both deltas (a content block's and the message's). Any other shape fails validation and
# takes the lenient path.
class _Delta(msgspec.Struct):
    type: str | None = None
    text: str | None = None
    partial_json: str | None = None
    thinking: str | None = None
    stop_reason: str | None = None


class _Message(msgspec.Struct):
    usage: msgspec.Raw = ABSENT


class _Event(msgspec.Struct):
    type: str = ""
    index: int | None = None
    delta: _Delta | None = None
    usage: msgspec.Raw = ABSENT
    message: _Message | None = None
    error: msgspec.Raw = ABSENT


_decode = msgspec.json.Decoder(_Event).decode
_NOT_JSON = "upstream sent an event that is not valid JSON"
#: A content_block_delta event's head (its data follows).
DELTA_EVENT = b"event: content_block_delta\ndata: "
#: A text block's merge kind by its index, the usual ones made once (a token's f-string
#: took 80 ns of its ~2.1 us; a lookup 40).
TEXT_KINDS = tuple(f"text:{i}" for i in range(16))
#: The delta types whose text is content (a token each); only text_delta merges.
_CONTENT = {"text_delta": "text", "input_json_delta": "partial_json", "thinking_delta": "thinking"}


def _fault(why: str) -> sse.SSEProtocolError:
    return sse.SSEProtocolError(why)


def _count(value: object) -> int | None:
    return value if type(value) is int and 0 <= value <= MAX_COUNT else None


def openai_usage(usage: object) -> dict[str, Any] | None:
    """Anthropic's usage in OpenAI's shape (what quotas, limiter and metrics count; see
    Piece.usage): prompt_tokens is all input, cache reads and writes included (Anthropic:
    "total input tokens is the sum"), which the cache keys also give on their own.
    Counts that are not plain ints in range are left out (usage.py checks them again)."""
    if not isinstance(usage, dict):
        return None
    out: dict[str, Any] = {}
    inp = _count(usage.get("input_tokens"))
    written = _count(usage.get("cache_creation_input_tokens"))
    read = _count(usage.get("cache_read_input_tokens"))
    if inp is not None:
        out["prompt_tokens"] = inp + (written or 0) + (read or 0)
    if written is not None:
        out["cache_creation_input_tokens"] = written
    if read is not None:
        out["cache_read_input_tokens"] = read
    completion = _count(usage.get("output_tokens"))
    if completion is not None:
        out["completion_tokens"] = completion
        if inp is not None:
            out["total_tokens"] = out["prompt_tokens"] + completion
    return out or None


class MessagesDialect(Dialect):
    """POST /messages. Shared and stateless; `for_stream` gives each stream its own reader,
    which joins the usage Anthropic spreads over message_start and message_delta."""

    name = "messages"
    api = "anthropic"
    path = "/messages"
    named = raw_named = True

    def read(
        self, data: bytes, event: str | None, raw: bytes | None, strip_usage: bool
    ) -> Piece | None:
        piece, usage = self._read(data, event, raw)
        if usage is not None:
            piece.usage = openai_usage(usage)
        return piece

    def _read(
        self, data: bytes, event: str | None, raw: bytes | None
    ) -> tuple[Piece, dict[str, Any] | None]:
        """The piece, and the usage the event carried as the upstream wrote it (the caller
        sets the piece's: a stream's reader translates the usage joined so far, once)."""
        try:
            ev = _decode(data)
        except msgspec.ValidationError:
            ev = _general(data)  # another shape, or numbers out of range
        except (msgspec.DecodeError, RecursionError):  # not JSON, or nested too deep
            raise _fault("upstream sent an event that is not JSON") from None
        kind = ev.type or event or ""
        if raw is None or not event:  # (not as read, or without its name: written here)
            if data.find(b"\n") >= 0:  # a multi-line `data:` event (JSON: line ends are spaces)
                data = data.replace(b"\n", b" ")
            raw = b"event: " + (event or kind).encode() + b"\ndata: " + data + b"\n\n"
        usage = None
        if kind == "content_block_delta":
            delta = ev.delta
            key = _CONTENT.get(delta.type or "") if delta is not None else None
            text = getattr(delta, key) if key is not None else None
            if not text:  # signature, citations, an empty delta: no token
                return Piece(raw), None
            piece = Piece(raw, [text])
            index = ev.index
            if key == "text" and index is not None:  # text merges within its block
                kind = TEXT_KINDS[index] if 0 <= index < 16 else f"text:{index}"
                piece.may_merge, piece.kind, piece.dialect = True, kind, self
            return piece, None
        piece = Piece(raw)
        if kind == "message_start":
            usage = object_of(ev.message.usage) if ev.message is not None else None
        elif kind == "message_delta":
            usage = object_of(ev.usage)
            reason = ev.delta.stop_reason if ev.delta is not None else None
            if reason:  # Anthropic's own value (end_turn, max_tokens, tool_use, ...)
                piece.finish_reason = reason
        elif kind == "message_stop":
            piece.end = True
        elif kind == "error":
            piece.error = object_of(ev.error) or {"type": "api_error"}
            piece.end = True
        return piece, usage

    def for_stream(self) -> Dialect:
        return _StreamReader()

    def usage_of(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        return openai_usage(obj.get("usage"))

    def error_body(self, error: GatewayError) -> bytes:
        return error_json(error)

    def error_event(self, error: GatewayError) -> bytes:
        return b"event: error\ndata: " + error_json(error) + b"\n\n"

    def template(self, raw: bytes) -> tuple[Any, str] | None:
        """The typed read skipped the fields it does not act on; a broken value there (a
        number out of a double's range, nesting too deep) shows only now: the upstream's
        broken JSON. An event that would not serialise again is passed on as it came."""
        if not raw.startswith(DELTA_EVENT):
            return None
        try:
            obj = orjson.loads(raw[len(DELTA_EVENT) : -2])
            orjson.dumps(obj)  # a merged event is rebuilt from it: it must serialise
        except orjson.JSONEncodeError:
            return None
        except (orjson.JSONDecodeError, RecursionError):
            raise _fault(_NOT_JSON) from None
        delta, index = obj.get("delta"), obj.get("index")
        if (
            type(index) is int
            and isinstance(delta, dict)
            and len(delta) == 2
            and delta.get("type") == "text_delta"
            and isinstance(delta.get("text"), str)
        ):
            return obj, f"text:{index}"
        return None

    def render(self, template: Any, kind: str, text: str) -> bytes:
        template["delta"]["text"] = text
        return DELTA_EVENT + orjson.dumps(template) + b"\n\n"


class _StreamReader(MessagesDialect):
    """One stream's reader. Anthropic's usage is cumulative and split: message_start has the
    input (and cache) tokens, each message_delta the output tokens so far (and, from some
    servers, the input again). The relay keeps the last usage a piece carries, so each piece
    carries everything known by then: the counts seen so far, later ones winning."""

    def __init__(self) -> None:
        self._usage: dict[str, Any] = {}

    def read(
        self, data: bytes, event: str | None, raw: bytes | None, strip_usage: bool
    ) -> Piece | None:
        piece, usage = self._read(data, event, raw)
        if usage:
            self._usage.update(usage)
            piece.usage = openai_usage(self._usage)
        return piece

    def for_stream(self) -> Dialect:
        return _StreamReader()


class CountTokensDialect(MessagesDialect):
    """POST /messages/count_tokens: a non-streamed answer `{"input_tokens": N}`, passed on.
    Counting costs no tokens at Anthropic: its usage is zero, so the reservation the limiter
    and the key's quota made for it comes back whole."""

    name = "count_tokens"
    label = "messages"  # the metrics' `api`: a route of the Messages API
    path = "/messages/count_tokens"

    def usage_of(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        return {"prompt_tokens": 0, "completion_tokens": 0}


def _general(data: bytes) -> _Event:
    """An event of a shape the typed decode refused, read from its dict (event_json.lenient):
    fields of unexpected types are not acted on (the event is still passed on as it came)."""
    obj = lenient(data)
    ev = _Event(type=_str(obj.get("type")) or "", error=raw_object(obj.get("error")))
    index = obj.get("index")
    if type(index) is int:
        ev.index = index
    delta = obj.get("delta")
    if isinstance(delta, dict):
        ev.delta = _Delta(**{f: _str(delta.get(f)) for f in _Delta.__struct_fields__})
    ev.usage = raw_object(obj.get("usage"))
    message = obj.get("message")
    if isinstance(message, dict):
        ev.message = _Message(raw_object(message.get("usage")))
    return ev


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


MESSAGES = MessagesDialect()
COUNT_TOKENS = CountTokensDialect()
