"""An Anthropic Messages client on an OpenAI chat upstream: the request written as a chat
request (chat_request.py), and the chat stream (or completion) written back as Messages events
(or a Message).

The stream: the role chunk opens the message (`message_start`); content, reasoning and each
tool call open a content block of their own (text, thinking, tool_use) closed when the next
begins or the answer finishes; `[DONE]` ends it with `message_delta` (stop reason, usage) and
`message_stop`. Text deltas of one block merge for a slow reader.

One instance per request: the translation has state (the open block, the tool calls' blocks).
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from tokenpipe import sse
from tokenpipe.dialects.anthropic import ERROR_TYPES, TEXT_KINDS
from tokenpipe.dialects.base import Dialect, Piece
from tokenpipe.dialects.chat_request import chat_request
from tokenpipe.dialects.chat_upstream import lone_text, read_chunk, read_completion
from tokenpipe.dialects.event_json import fragment
from tokenpipe.errors import GatewayError
from tokenpipe.usage import count

#: chat's finish reasons as Anthropic's stop reasons.
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for `status` (anthropic.ERROR_TYPES; another 4xx is an
    invalid_request_error, another 5xx an api_error)."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **obj}) + b"\n\n"


def messages_usage(usage: Any) -> dict[str, int]:
    """OpenAI's usage as Anthropic's: input tokens without the cached ones, which are apart."""
    usage = usage if isinstance(usage, dict) else {}
    prompt = count(usage.get("prompt_tokens"))
    details = usage.get("prompt_tokens_details")
    cached = count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    uncached = prompt - cached  # (max(): ~700 instructions)
    return {
        "input_tokens": uncached if uncached > 0 else 0,
        "output_tokens": count(usage.get("completion_tokens")),
        "cache_read_input_tokens": cached,
    }


class MessagesViaChat(Dialect):
    """A Messages request's dialect on an OpenAI chat upstream (see the module docstring)."""

    answers_as_sent = False

    name = "messages"
    api = "openai"
    path = "/chat/completions"

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        self.model = str(request.get("model") or "")
        self.started = False
        self.block: tuple[str, int] | None = None  # the open block: its kind and index
        self.blocks = 0  # blocks opened so far
        self.tools: dict[int, int] = {}  # chat tool_calls index -> block index
        self.stop = "end_turn"
        self.usage: dict[str, Any] | None = None

    def upstream_request(self, request: dict[str, Any]) -> dict[str, Any] | None:
        return chat_request(request)

    def for_stream(self) -> Dialect:
        """A fresh translation for the relayed stream (see Dialect.for_stream)."""
        return MessagesViaChat(self.request)

    # -- the stream --------------------------------------------------------------------------

    def _start(self, obj: dict[str, Any]) -> bytes:
        if self.started:
            return b""
        self.started = True
        message: dict[str, Any] = {
            "id": "msg_" + str(obj.get("id") or ""),
            "type": "message",
            "role": "assistant",
            "model": str(obj.get("model") or self.model),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return _event("message_start", {"message": message})

    def _open(self, kind: str, block: dict[str, Any], key: int | None = None) -> bytes:
        """Closes the open block (if another) and opens `block`; returns the events."""
        if self.block is not None and self.block[0] == kind and key is None:
            return b""
        out = self._close()
        index = self.blocks
        self.blocks += 1
        self.block = (kind, index)
        if key is not None:
            self.tools[key] = index
        return out + _event("content_block_start", {"index": index, "content_block": block})

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        index = self.block[1]
        self.block = None
        return _event("content_block_stop", {"index": index})

    def read(
        self, data: bytes, event: str | None, raw: bytes | None, strip_usage: bool
    ) -> Piece | None:
        if data == sse.DONE:
            out = self._start({}) + self._close()
            usage = messages_usage(self.usage)
            end = {"delta": {"stop_reason": self.stop, "stop_sequence": None}, "usage": usage}
            piece = Piece(out + _event("message_delta", end) + _event("message_stop", {}))
            piece.end = True
            return piece
        obj = read_chunk(data)
        # The usual chunk, one text delta of the open text block: its event at once,
        # without the general path's calls and lists (~0.5 us of a token's ~2.2).
        open_ = self.block
        if open_ is not None and open_[0] == "text" and (text := lone_text(obj)) is not None:
            return self._text_piece(open_[1], text)
        choices = obj.get("choices")
        if isinstance(obj.get("error"), dict):
            err = obj["error"]
            body = anthropic_error(502, str(err.get("message") or "upstream error"))
            piece = Piece(_event("error", {"error": body["error"]}))
            piece.error, piece.end = body["error"], True
            return piece
        out = self._start(obj)
        made: Piece | None = None  # (made once: the content's, else one for `out`)
        reason = None
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            delta: dict[str, Any] = choice.get("delta") or {}
            made = self._content(delta if isinstance(delta, dict) else {}, out)
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                self.stop = STOP_REASONS.get(reason, "end_turn")
            else:
                reason = None
        counts = obj.get("usage")
        if isinstance(counts, dict) and counts:
            self.usage = counts
        else:
            counts = None
        if made is None:
            if not out and counts is None and reason is None:
                return None
            made = Piece(out)
        if reason is not None:
            made.finish_reason = reason
        if counts is not None:
            made.usage = counts
        return made

    def _content(self, delta: dict[str, Any], head: bytes) -> Piece | None:
        """The events of one chat delta (after `head`), as one piece; None: no content. The
        events are joined once (added to bytes one by one, a delta of N tool calls cost
        O(N^2): 9 s for one of 489 KiB, benchmarks/hostile_cost.py)."""
        out = [head]
        count = 0
        text = ""
        lone = False  # one text delta with no other event: it may merge with its neighbours
        text_piece: Piece | None = None
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out.append(
                self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            )
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            count += 1
        content = delta.get("content")
        if isinstance(content, str) and content:
            open_ = self.block
            if open_ is None or open_[0] != "text":
                out.append(self._open("text", {"type": "text", "text": ""}))
                open_ = self.block
                assert open_ is not None
            else:  # the text block goes on
                lone = not any(out)  # (at most 3 parts so far)
            text_piece = self._text_piece(open_[1], content)
            assert text_piece.raw is not None
            out.append(text_piece.raw)
            count += 1
            text = content
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            key = call.get("index", 0)
            fn: dict[str, Any] = call.get("function") or {}
            if not isinstance(fn, dict):
                fn = {}
            if key not in self.tools:
                block: dict[str, Any] = {
                    "type": "tool_use",
                    "id": call.get("id"),
                    "name": fn.get("name"),
                    "input": {},
                }
                out.append(self._open("tool_use", block, key))
            args = fn.get("arguments")
            if isinstance(args, str) and args:
                partial = {"type": "input_json_delta", "partial_json": args}
                out.append(
                    _event("content_block_delta", {"index": self.tools[key], "delta": partial})
                )
            count += 1
            lone = False
        if not count:
            return None
        if lone and text_piece is not None:  # one text delta and nothing else
            return text_piece
        return Piece(b"".join(out), [text] + [""] * (count - 1))

    def _text_piece(self, index: int, text: str) -> Piece:
        """A text delta of block `index` (the translation's own count: not negative), its
        event written from the block's head and the text's JSON; it merges with its
        neighbours of that block."""
        if index < 16:
            head, kind = _TEXT_HEADS[index], TEXT_KINDS[index]
        else:
            head, kind = _text_head(index), f"text:{index}"
        piece = Piece(head + orjson.dumps(text) + _TEXT_TAIL, [text])
        piece.may_merge, piece.kind, piece.dialect = True, kind, self
        return piece

    def _delta(self, delta: dict[str, Any]) -> bytes:
        assert self.block is not None
        return _event("content_block_delta", {"index": self.block[1], "delta": delta})

    def template(self, raw: bytes) -> tuple[Any, str] | None:
        obj = orjson.loads(raw[raw.index(b"\ndata: ") + 7 : -2])
        return obj, f"text:{obj['index']}"

    def render(self, template: Any, kind: str, text: str) -> bytes:
        return _event(
            "content_block_delta",
            {"index": template["index"], "delta": {"type": "text_delta", "text": text}},
        )

    # -- whole answers and errors --------------------------------------------------------------

    def parse_answer(self, body: bytes) -> Any:
        return read_completion(body)

    def usage_of(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        usage = obj.get("usage")
        return usage if isinstance(usage, dict) else None

    def answer(self, body: bytes, obj: dict[str, Any]) -> bytes:
        choices = obj.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") or {}
        content: list[dict[str, Any]] = []
        if message.get("content"):
            content.append({"type": "text", "text": str(message["content"])})
        for call in message.get("tool_calls") or ():
            fn = call.get("function") or {}
            args = _tool_input(fn.get("arguments") or "{}")
            content.append(
                {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": args}
            )
        out = {
            "id": "msg_" + str(obj.get("id") or ""),
            "type": "message",
            "role": "assistant",
            "model": obj.get("model") or self.model,
            "content": content,
            "stop_reason": STOP_REASONS.get(str(choice.get("finish_reason")), "end_turn"),
            "stop_sequence": None,
            "usage": messages_usage(obj.get("usage")),
        }
        return orjson.dumps(out)

    def upstream_error_body(self, status: int, obj: Any) -> bytes | None:
        err = obj.get("error") if isinstance(obj, dict) else None
        message = err.get("message") if isinstance(err, dict) else None
        return orjson.dumps(anthropic_error(status, str(message or f"Upstream answered {status}.")))

    def error_body(self, error: GatewayError) -> bytes:
        return orjson.dumps(anthropic_error(error.status, error.message))

    def error_event(self, error: GatewayError) -> bytes:
        return _event("error", {"error": anthropic_error(error.status, error.message)["error"]})


def _text_head(index: int) -> bytes:
    """A text delta's event up to its text: `_event`'s bytes for it with an empty text, cut
    before that text (`""`) and _TEXT_TAIL. A token is this, its text's JSON and the tail."""
    event = _event("content_block_delta", {"index": index, "delta": _EMPTY_TEXT})
    return event[: -2 - len(_TEXT_TAIL)]


_EMPTY_TEXT = {"type": "text_delta", "text": ""}
#: A text delta's event after its text.
_TEXT_TAIL = b"}}\n\n"
#: The usual blocks' heads, made once (a token's dicts built and serialised cost ~0.8 us of
#: its ~3 us; the head and the text's JSON joined, ~0.2).
_TEXT_HEADS = tuple(_text_head(i) for i in range(16))

_validate = msgspec.json.Decoder(msgspec.Raw).decode


def _tool_input(arguments: Any) -> Any:
    """A chat tool call's arguments (JSON text) as a Messages tool input: checked as JSON and
    written as it came, not built (an upstream's arguments may be MiBs of it); {} when they
    are not JSON."""
    try:
        return fragment(_validate(arguments))
    except (msgspec.DecodeError, TypeError, RecursionError):  # (TypeError: not text)
        return {}
