"""An OpenAI chat client on an Anthropic Messages upstream: the request written as a Messages
request, and the Messages stream (or body) written back as chat chunks (or a chat completion).

What both APIs express is translated: system and developer messages, text and image parts,
tools and `tool_choice`, assistant tool calls <-> `tool_use` blocks, tool results <->
`tool_result` blocks, streamed tool-call arguments <-> `input_json_delta`, reasoning <->
thinking deltas, stop reasons, usage (cache tokens included), errors and `max_tokens` (required
by Anthropic: DEFAULT_MAX_TOKENS when the chat request has none). What cannot be expressed is a
400 naming the field (`UNSUPPORTED`), never dropped.

One instance per request (`ChatViaMessages(request)`): the stream's translation has state (the
message id, which block is which tool call, whether usage was asked for).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, TypedDict

import msgspec
import orjson

from tokenpipe import sse
from tokenpipe.dialects import event_json
from tokenpipe.dialects.base import Dialect, Piece
from tokenpipe.dialects.chat_request import tool_call
from tokenpipe.dialects.event_json import MAX_ITEMS, fragment, lenient, not_json, object_of
from tokenpipe.dialects.messages_request import messages_request
from tokenpipe.dialects.openai import CHAT
from tokenpipe.usage import count

#: Anthropic's stop reasons as chat's finish reasons (any other: "stop").
_STOP = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


#: A text chunk's bytes after its text (ChatViaMessages._text_head).
_TEXT_TAIL = b'},"logprobs":null,"finish_reason":null}]}\n\n'


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """Anthropic's usage in OpenAI's shape: prompt tokens include the cached ones (read and
    written), as OpenAI counts them; `prompt_tokens_details.cached_tokens` the read ones."""
    if not isinstance(usage, dict):
        return None
    read = count(usage.get("cache_read_input_tokens"))
    written = count(usage.get("cache_creation_input_tokens"))
    prompt = count(usage.get("input_tokens")) + read + written
    completion = count(usage.get("output_tokens"))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": read},
    }


def finish_reason(stop: Any) -> str | None:
    if not isinstance(stop, str):
        return None
    return _STOP.get(stop, "stop")


# A Messages event as the translation reads it: the fields it turns into chat chunks, and
# nothing else (event_json.py). TypedDicts, so a decoded event is the plain dict a whole parse
# gives, holding only these keys, read with `.get` and type checks either way.
class _Block(TypedDict, total=False):  # (a block started, or an answer's)
    type: str | None
    text: str | None
    thinking: str | None
    id: str | None
    name: str | None
    input: msgspec.Raw  # written again as it came: event_json.fragment


class _Message(TypedDict, total=False):
    id: str | None
    model: str | None
    usage: msgspec.Raw  # objects built only when small: event_json.object_of


class _Delta(TypedDict, total=False):
    type: str | None
    text: str | None
    thinking: str | None
    partial_json: str | None
    stop_reason: str | None


class _Event(TypedDict, total=False):
    type: str | None
    index: int | None
    message: _Message | None
    content_block: _Block | None
    delta: _Delta | None
    usage: msgspec.Raw
    error: msgspec.Raw


class _Answer(TypedDict, total=False):
    id: str | None
    model: str | None
    content: Annotated[list[_Block], msgspec.Meta(max_length=MAX_ITEMS)] | None
    stop_reason: str | None
    usage: msgspec.Raw


_decode = msgspec.json.Decoder(_Event).decode
_decode_answer = msgspec.json.Decoder(_Answer).decode


def _read_event(data: bytes) -> dict[str, Any]:
    """The event's fields the translation reads, objects built (or None); raises
    sse.SSEProtocolError when it is not JSON, not an object, or (over
    event_json.MAX_LENIENT_BYTES) not of this shape."""
    # (event_json.answer's steps, written out: this runs per token, and a call is ~1%.)
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
    if "message" in obj and obj["message"] is not None and "usage" in obj["message"]:
        obj["message"]["usage"] = object_of(obj["message"]["usage"])
    return obj


class ChatViaMessages(Dialect):
    """A chat request's dialect on an Anthropic upstream (see the module docstring)."""

    answers_as_sent = False

    name = "chat"
    api = "anthropic"
    path = "/messages"
    named = True  # (its events are its own: `raw_named` stays False)

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        opts = request.get("stream_options")
        #: The client asked for the usage chunk (Anthropic always sends usage).
        self.include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        self.model = str(request.get("model") or "")
        self.id = "chatcmpl-"
        self.created = int(time.time())
        self.usage: dict[str, Any] = {}
        #: `usage` in chat's shape as the last message_delta's piece carried it.
        self.counted: dict[str, Any] | None = None
        #: Anthropic content block index -> chat tool_calls index.
        self.tools: dict[int, int] = {}
        #: A text chunk's bytes up to its text (`_delta`), made at the first; None: not yet,
        #: or the message's id or model changed since.
        self.text_head: bytes | None = None

    def upstream_request(self, request: dict[str, Any]) -> dict[str, Any] | None:
        return messages_request(request)

    def for_stream(self) -> Dialect:
        """A fresh translation for the relayed stream (see Dialect.for_stream)."""
        return ChatViaMessages(self.request)

    # -- the stream --------------------------------------------------------------------------

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None) -> bytes:
        choices = (
            []
            if delta is None
            else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        )
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        return sse.encode(orjson.dumps(obj))

    def _text_head(self) -> bytes:
        """A text chunk up to its text: `_chunk`'s bytes for {"content": ...} (tested), the
        text's JSON and _TEXT_TAIL to follow (its dicts built and serialised were ~0.6 us of
        a token's ~1.9)."""
        head = self._chunk({"content": ""})
        return head[: head.rindex(b'"content":') + 10]  # (the last key: after it, "")

    def read(
        self, data: bytes, event: str | None, raw: bytes | None, strip_usage: bool
    ) -> Piece | None:
        obj = _read_event(data)
        kind = obj.get("type") or event
        if kind == "content_block_delta":  # (the usual event first)
            return self._delta(obj)
        if kind == "message_start":
            msg = obj.get("message") or {}
            self.id = "chatcmpl-" + str(msg.get("id") or "")
            self.model = str(msg.get("model") or self.model)
            self.usage.update(msg.get("usage") or {})
            self.counted = None
            self.text_head = None
            return Piece(self._chunk({"role": "assistant", "content": ""}))
        if kind == "content_block_start":
            block = obj.get("content_block") or {}
            if block.get("type") == "tool_use":
                n = self.tools[obj.get("index", 0)] = len(self.tools)
                call = {
                    "index": n,
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": ""},
                }
                return Piece(self._chunk({"tool_calls": [call]}), [""])
            return None
        if kind == "message_delta":
            delta = obj.get("delta") or {}
            self.usage.update(obj.get("usage") or {})
            reason = finish_reason(delta.get("stop_reason"))
            piece = Piece(self._chunk({}, reason))
            piece.finish_reason = reason
            piece.usage = self.counted = chat_usage(self.usage)
            return piece
        if kind == "message_stop":
            out = b""
            # (as the last message_delta counted it, unless a stream had none)
            usage = self.counted if self.counted is not None else chat_usage(self.usage)
            if self.include_usage and usage is not None:
                obj = {
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": usage,
                }
                out = sse.encode(orjson.dumps(obj))
            piece = Piece(out + sse.DONE_EVENT)
            piece.end = True
            return piece
        if kind == "error":
            error = _openai_error(obj.get("error"), "upstream error")
            piece = Piece(sse.encode(orjson.dumps({"error": error})))
            piece.error = error
            piece.end = True
            return piece
        return None  # ping, content_block_stop, and events chat has no counterpart for

    def _delta(self, obj: dict[str, Any]) -> Piece | None:
        delta = obj.get("delta") or {}
        kind = delta.get("type")
        if kind == "text_delta":
            text = str(delta.get("text") or "")
            if not text:
                return None
            head = self.text_head
            if head is None:
                head = self.text_head = self._text_head()
            piece = Piece(head + orjson.dumps(text) + _TEXT_TAIL, [text])
            piece.may_merge, piece.kind, piece.dialect = True, "content", CHAT
            return piece
        if kind == "thinking_delta":
            text = str(delta.get("thinking") or "")
            return Piece(self._chunk({"reasoning_content": text}), [""]) if text else None
        if kind == "input_json_delta":
            n = self.tools.get(obj.get("index", 0))
            if n is None:
                return None
            call = {"index": n, "function": {"arguments": str(delta.get("partial_json") or "")}}
            return Piece(self._chunk({"tool_calls": [call]}), [""])
        return None  # signature_delta, citations: nothing in chat's stream

    # -- whole answers and errors --------------------------------------------------------------

    def parse_answer(self, body: bytes) -> Any:
        """The answer's fields `answer` reads: `usage` an object (or None), a tool's `input`
        kept as its JSON text (see event_json.py)."""
        obj = event_json.answer(_decode_answer, body)
        if obj is None:
            return None
        if isinstance(raw := obj.get("usage"), msgspec.Raw):
            obj["usage"] = object_of(raw)
        content = obj.get("content")
        for block in content if isinstance(content, list) else ():  # (lenient: any JSON)
            if isinstance(block, dict) and isinstance(raw := block.get("input"), msgspec.Raw):
                block["input"] = fragment(raw)
        return obj

    def usage_of(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        return chat_usage(obj.get("usage"))

    def answer(self, body: bytes, obj: dict[str, Any]) -> bytes:
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in obj.get("content") or ():
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(str(block.get("text") or ""))
            elif kind == "tool_use":
                calls.append(tool_call(block))
            elif kind == "thinking":
                reasoning.append(str(block.get("thinking") or ""))
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        out = {
            "id": "chatcmpl-" + str(obj.get("id") or ""),
            "object": "chat.completion",
            "created": self.created,
            "model": obj.get("model") or self.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": finish_reason(obj.get("stop_reason")) or "stop",
                }
            ],
            "usage": chat_usage(obj.get("usage")),
        }
        return orjson.dumps(out)

    def upstream_error_body(self, status: int, obj: Any) -> bytes | None:
        err = obj.get("error") if isinstance(obj, dict) else None
        if not isinstance(err, dict):
            return None
        error = _openai_error(err, f"Upstream answered with status {status}.")
        return orjson.dumps({"error": error})


def _openai_error(err: Any, default: str) -> dict[str, Any]:
    """Anthropic's `{"type", "message"}` error as OpenAI's error object."""
    err = err if isinstance(err, dict) else {}
    kind = str(err.get("type") or "upstream_error")
    return {
        "message": str(err.get("message") or default),
        "type": kind,
        "param": None,
        "code": kind,
    }
