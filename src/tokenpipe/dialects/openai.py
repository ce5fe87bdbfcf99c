"""OpenAI's streamed chat and text completions: `data: {chunk}` events, `data: [DONE]` last.

Per event only the fields the gateway acts on are decoded (msgspec, typed: about 1 us, a third
of what a dict parse plus lookups costs); the whole chunk is parsed into a dict only when it
merges, or when its shape is one the typed decode refuses (then it is judged on the dict).
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from tokenpipe import sse
from tokenpipe.dialects.base import Dialect, Piece
from tokenpipe.dialects.event_json import (
    ABSENT,
    MAX_LENIENT_BYTES,
    NULL,
    Opaque,
    is_null,
    lenient,
    object_of,
    says_something,
)
from tokenpipe.settings import UpstreamSettings


def chunk_has_content(obj: dict[str, Any]) -> bool:
    """True if a chunk carries output: content, reasoning or a tool call (not a role-only chunk)."""
    choices = obj.get("choices")
    return _choices_have_content(choices) if choices else False


def _choices_have_content(choices: list[dict[str, Any]]) -> bool:
    for choice in choices:
        delta = choice.get("delta")
        if delta is None:  # text completion
            if choice.get("text"):
                return True
        elif (
            delta.get("content")
            or delta.get("tool_calls")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
            or delta.get("function_call")
        ):
            return True
    return False


# The fields of a streamed chunk the relay acts on (event_json.py: what is Raw and why).
# Events of any other shape fail validation and take the lenient path (`_general`).
class _Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    tool_calls: msgspec.Raw = ABSENT
    reasoning_content: str | None = None
    reasoning: str | None = None
    function_call: msgspec.Raw = ABSENT


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None
    logprobs: Opaque | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: msgspec.Raw = ABSENT
    error: msgspec.Raw = ABSENT


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_NOT_VALID_JSON = "upstream sent an event that is not valid JSON"
#: `"usage":null` as OpenAI-compatible servers write it after the choices: compactly, or with
#: the spaces of Python's json.dumps.
_NULL_USAGE = b',"usage":null'
_NULL_USAGE_SPACED = b', "usage": null'


def _fault(why: str) -> sse.SSEProtocolError:
    return sse.SSEProtocolError(why)


def _has_content(choices: list[_Choice]) -> bool:
    for c in choices:
        d = c.delta
        if d is None:
            if c.text:
                return True
        elif (
            d.content
            or (d.tool_calls is not ABSENT and says_something(d.tool_calls))
            or d.reasoning_content
            or d.reasoning
            or (d.function_call is not ABSENT and says_something(d.function_call))
        ):
            return True
    return False


class OpenAIDialect(Dialect):
    """What chat and completions share: the chunk, its reading, merging and rendering."""

    def read(
        self, data: bytes, event: str | None, raw: bytes | None, strip_usage: bool
    ) -> Piece | None:
        if data == sse.DONE:
            piece = Piece(sse.DONE_EVENT)
            piece.end = True
            return piece
        try:
            c = _decode_chunk(data)
        except msgspec.ValidationError:
            return self._general(data, strip_usage)  # another shape, or numbers out of range
        except (msgspec.DecodeError, RecursionError):  # not JSON, or nested too deep
            raise _fault("upstream sent an event that is not JSON") from None
        if raw is None and data.find(b"\n") >= 0:  # (`_one_line`, inline: it runs per event)
            data = data.replace(b"\n", b" ")
        # The decoded chunk -> its piece (here, not in a method of its own: one frame fewer
        # a token, ~1% of its cost). `raw`: the event's bytes as read, if they are exactly
        # `data: <data>\n\n` (saves rebuilding them).
        usage = None
        if c.usage is not ABSENT:  # present, if only as null (as in every chunk, asked for)
            usage = None if c.usage == NULL else object_of(c.usage) or None
            if strip_usage:
                if not c.choices:  # the usage-only chunk the client did not ask for
                    return _hidden(usage)
                # `"usage":null` is there only because we asked for usage. Cutting its bytes
                # saves a re-serialisation.
                if raw is not None and len(cut := raw.replace(_NULL_USAGE, b"", 1)) != len(raw):
                    raw = cut  # (`data` is not read again once `raw` is known)
                elif raw is None and len(cut := data.replace(_NULL_USAGE, b"", 1)) != len(data):
                    data = cut  # (as `_without_usage` would first: one call fewer an event)
                else:
                    stripped = _without_usage(data)
                    if stripped is None:
                        raise _fault(_NOT_VALID_JSON)
                    raw, data = None, stripped
        if raw is None:
            raw = b"data: " + data + b"\n\n"
        choices = c.choices
        if not choices:
            piece = Piece(raw)
            piece.usage = usage
            error = object_of(c.error) if c.error is not ABSENT else None
            if error is not None:
                piece.error = error
                piece.end = True
            return piece
        first = choices[0]
        if len(choices) == 1:
            delta = first.delta
            text = first.text if delta is None else delta.content
            if text:  # the usual chunk: one choice, plain text
                piece = Piece(raw, [text])
                piece.usage = usage
                if first.finish_reason:
                    piece.finish_reason = first.finish_reason
                elif first.finish_reason is None and first.logprobs is None:
                    if delta is None:
                        piece.may_merge, piece.kind, piece.dialect = True, "text", self
                    elif (  # (ABSENT tested first: no call for the usual chunk)
                        delta.role is None
                        and (delta.tool_calls is ABSENT or is_null(delta.tool_calls))
                        and (delta.function_call is ABSENT or is_null(delta.function_call))
                        and delta.reasoning_content is None
                        and delta.reasoning is None
                    ):
                        piece.may_merge, piece.kind, piece.dialect = True, "content", self
                return piece
        piece = Piece(raw, [_text_of(first)]) if _has_content(choices) else Piece(raw)
        piece.usage = usage
        if first.finish_reason:
            piece.finish_reason = first.finish_reason
        return piece

    def _general(self, data: bytes, strip_usage: bool) -> Piece | None:
        """A JSON event of a shape the typed decode refused: judged on the dict. Fields of
        unexpected types are passed through, not acted on."""
        obj = lenient(data)
        data = _one_line(data)
        choices = obj.get("choices")
        if not (isinstance(choices, list) and all(type(c) is dict for c in choices)):
            choices = None
        usage = None
        if "usage" in obj:
            if isinstance(obj["usage"], dict) and obj["usage"]:
                usage = obj["usage"]
            if strip_usage:
                if not choices:  # the usage-only chunk the client did not ask for
                    return _hidden(usage)
                del obj["usage"]
                try:
                    data = orjson.dumps(obj)
                except orjson.JSONEncodeError:  # nested deeper than orjson writes
                    raise _fault("upstream sent an event nested too deep to pass on") from None
        piece = Piece(b"data: " + data + b"\n\n")
        if choices:
            try:
                if _choices_have_content(choices):
                    piece = Piece(piece.raw, [_choice_text(choices[0])])
            except AttributeError:  # a delta that is not an object: no content we can read
                pass
            reason = choices[0].get("finish_reason")
            if isinstance(reason, str) and reason:
                piece.finish_reason = reason
        elif isinstance(obj.get("error"), dict):
            piece.error = obj["error"]
            piece.end = True
        piece.usage = usage
        return piece

    def template(self, raw: bytes) -> tuple[Any, str] | None:
        """The typed decode that let the piece through skips the fields it does not act on
        without checking them; a number there out of a double's range (`1e400`) or nesting
        deeper than orjson goes only shows now: the upstream's broken JSON. A piece that
        parses but could not be written again (nested too deep to serialise) is passed on as
        it came."""
        try:
            obj = orjson.loads(raw[6:-2])
            orjson.dumps(obj)  # a merged event is rebuilt from it: it must serialise
        except orjson.JSONEncodeError:
            return None
        except (orjson.JSONDecodeError, RecursionError):
            raise _fault(_NOT_VALID_JSON) from None
        kind = _mergeable(obj, obj["choices"])
        return (obj, kind) if kind else None

    def render(self, template: Any, kind: str, text: str) -> bytes:
        choice = template["choices"][0]
        (choice["delta"] if kind == "content" else choice)[kind] = text
        return b"data: " + orjson.dumps(template) + b"\n\n"

    def strip_extensions(self, request: dict[str, Any]) -> bool:
        """`stream_options.max_tokens_per_second`: the pace the client renders at."""
        opts = request.get("stream_options")
        if isinstance(opts, dict) and "max_tokens_per_second" in opts:
            request["stream_options"] = {
                k: v for k, v in opts.items() if k != "max_tokens_per_second"
            }
            return True
        return False

    def wants_usage(self, request: dict[str, Any]) -> bool:
        opts = request.get("stream_options")
        return isinstance(opts, dict) and bool(opts.get("include_usage"))

    def ask_usage(self, request: dict[str, Any]) -> None:
        opts = request.get("stream_options")
        request["stream_options"] = {
            **(opts if isinstance(opts, dict) else {}),
            "include_usage": True,
        }

    def _remaining(self, obj: dict[str, Any], deltas: int) -> None:
        # One delta is one token for the servers we continue on (vLLM, llama.cpp, TGI and the
        # sim stream token by token); the remainder keeps the total length the client set.
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(obj.get(key), int):
                obj[key] = max(1, obj[key] - deltas)


class ChatDialect(OpenAIDialect):
    name = "chat"
    path = "/chat/completions"

    def continuable(self, request: dict[str, Any]) -> bool:
        """One choice, no tools: the messages + an assistant message holding the text so far,
        sent only to an upstream that continues a final assistant message (`continues_on`)."""
        return (
            _one_choice(request)
            and isinstance(request.get("messages"), list)
            and not request.get("tools")
            and not request.get("functions")
        )

    def continues_on(self, upstream: UpstreamSettings) -> bool:
        """`upstreams[].continue_final_message` (vLLM's parameter of that name): an
        OpenAI-compatible upstream in general would answer the continuation as a new turn."""
        return upstream.continue_final_message

    def continuation(self, request: dict[str, Any], text: str, deltas: int) -> bytes:
        obj = dict(request)
        obj["messages"] = [*request["messages"], {"role": "assistant", "content": text}]
        obj["continue_final_message"] = True
        obj["add_generation_prompt"] = False
        self._remaining(obj, deltas)
        return orjson.dumps(obj)


class CompletionsDialect(OpenAIDialect):
    name = "completions"
    path = "/completions"

    def continuable(self, request: dict[str, Any]) -> bool:
        """One string prompt and one choice: the continuation is the prompt + the text."""
        return (
            _one_choice(request)
            and isinstance(request.get("prompt"), str)
            and not request.get("echo")
            and request.get("best_of") in (None, 1)
            and request.get("suffix") is None
        )

    def continuation(self, request: dict[str, Any], text: str, deltas: int) -> bytes:
        obj = dict(request)
        obj["prompt"] = request["prompt"] + text
        self._remaining(obj, deltas)
        return orjson.dumps(obj)


def _hidden(usage: dict[str, Any] | None) -> Piece | None:
    """The usage of a chunk that is not passed on (None: it said nothing)."""
    if usage is None:
        return None
    piece = Piece(None)
    piece.usage = usage
    piece.hidden = True
    return piece


def _one_choice(obj: dict[str, Any]) -> bool:
    return obj.get("n") in (None, 1) and not obj.get("logprobs")


CHAT = ChatDialect()
COMPLETIONS = CompletionsDialect()


def _mergeable(obj: dict[str, Any], choices: list[dict[str, Any]]) -> str:
    """The key holding the text if this chunk is a plain content delta of one choice, else "".
    Role chunks, finish chunks, tool calls, logprobs and usage are never merged."""
    if len(choices) != 1 or obj.get("usage"):
        return ""
    choice = choices[0]
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return ""
    delta = choice.get("delta")
    if delta is None:
        return "text" if isinstance(choice.get("text"), str) and choice["text"] else ""
    if len(delta) == 1 and isinstance(delta.get("content"), str) and delta["content"]:
        return "content"
    return ""


def _one_line(data: bytes) -> bytes:
    """The data of a multi-line `data:` event (its lines joined by LF) on one line, as it is
    re-encoded under one `data: ` prefix. Called only on data that parsed as JSON, where an LF
    can only be whitespace between tokens (a raw LF in a string is not JSON)."""
    return data.replace(b"\n", b" ") if data.find(b"\n") >= 0 else data


def _without_usage(data: bytes) -> bytes | None:
    """The chunk without its `usage`; None if orjson cannot read or write it (msgspec skips
    the fields it does not decode without checking their numbers or depth). A chunk over
    MAX_LENIENT_BYTES keeps its usage: parsing it whole would cost the loop what it holds
    (event_json.py), and a usage the client did not ask for is an extra field, not a loss."""
    for null in (_NULL_USAGE, _NULL_USAGE_SPACED):  # as written: cut from the bytes
        cut = data.replace(null, b"", 1)
        if len(cut) != len(data):
            return cut
    if len(data) > MAX_LENIENT_BYTES:
        return data
    try:
        obj = orjson.loads(data)
        del obj["usage"]
        return orjson.dumps(obj)
    except (orjson.JSONDecodeError, orjson.JSONEncodeError, RecursionError):
        return None


def _text_of(choice: _Choice) -> str:
    d = choice.delta
    if d is None:
        return choice.text or ""
    return d.content or ""


def _choice_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if delta is None:
        return str(choice.get("text") or "")
    return str(delta.get("content") or "")
