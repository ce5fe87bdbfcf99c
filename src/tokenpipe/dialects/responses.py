"""OpenAI's Responses API, passed through natively to an upstream that serves /v1/responses.

A Responses stream is typed events (`event: TYPE` + `data: {"type": TYPE, ...}`), each with a
`sequence_number`, ending with `response.completed`, `response.incomplete`, `response.failed`
or `error` (no `[DONE]`). What the relay acts on: every `*.delta` event is output (the first
one ends the wait for the first token); `response.output_text.delta` events of one content
part merge for a reader that is behind (the first event's JSON carrying the joined text);
the terminal events carry the usage (`input_tokens`/`output_tokens`, translated into the
OpenAI chat shape that quotas and metrics count) and the end.

One instance per request: it remembers the highest sequence number read, so that an error the
gateway adds mid-stream (`error_event`) numbers after everything the client has seen. The
relayed stream is read by its `for_stream()`, which holds the events before the first output
(`response.created`, `response.in_progress`, the first item's `added` events) back and sends
them with it: a hedge or a retry that takes over before content is another response (its own
id), and the client must see one response only, whole (the SDK checks the identity).
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from tokenpipe import sse
from tokenpipe.dialects.base import Dialect, Piece
from tokenpipe.dialects.event_json import (
    ABSENT,
    Opaque,
    lenient,
    object_of,
    raw_object,
    says_something,
)
from tokenpipe.errors import GatewayError

TEXT_DELTA = "response.output_text.delta"
#: Terminal events -> the finish reason the relay records (failed: an error instead).
_FINISHED = {"response.completed": "stop", "response.incomplete": "length"}
#: `"logprobs": []`, as OpenAI writes it in every text delta (a Raw compares in C).
_NO_LOGPROBS = msgspec.Raw(b"[]")
_EVENT_TEXT_DELTA = b"event: " + TEXT_DELTA.encode() + b"\ndata: "
#: A content part's merge kind by its output and content index, the usual ones made once (a
#: token's f-string took 125 ns of its ~2.3 us; a lookup 60).
_PART_KINDS = tuple(tuple(f"t{out}.{part}" for part in range(4)) for out in range(8))


# Only the fields the relay acts on are decoded (msgspec skips the rest, e.g. a completed
# response's whole output; event_json.py: what is Raw and why); anything typed otherwise
# takes the lenient path (`_lenient`).
class _Response(msgspec.Struct):
    usage: msgspec.Raw = ABSENT
    error: msgspec.Raw = ABSENT


class _Event(msgspec.Struct):
    type: str = ""
    delta: str | Opaque | None = None  # (Opaque: a shell call's output delta)
    output_index: int | None = None
    content_index: int | None = None
    logprobs: msgspec.Raw = ABSENT
    sequence_number: int | None = None
    response: _Response | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None
    error: msgspec.Raw = ABSENT


_decode = msgspec.json.Decoder(_Event).decode


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """A Responses `usage` ({input_tokens, output_tokens, total_tokens}) in the OpenAI chat
    shape the gateway counts (usage.clean checks the values later)."""
    if not isinstance(usage, dict):
        return None
    out: dict[str, Any] = {
        "prompt_tokens": usage.get("input_tokens"),
        "completion_tokens": usage.get("output_tokens"),
    }
    if "total_tokens" in usage:
        out["total_tokens"] = usage["total_tokens"]
    return out


def error_of(e: _Event) -> dict[str, Any]:
    """The error of an `error` event: the spec's flat fields, or an `error` object inside."""
    return object_of(e.error) or {"message": e.message, "code": e.code, "param": e.param}


def encode_event(obj: dict[str, Any]) -> bytes:
    """One Responses SSE event: its type on the `event:` line, its JSON on the `data:` line."""
    return b"event: " + str(obj["type"]).encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def error_payload(error: GatewayError, sequence_number: int) -> dict[str, Any]:
    return {
        "type": "error",
        "code": error.code or error.type,
        "message": error.message,
        "param": error.param,
        "sequence_number": sequence_number,
    }


class ResponsesDialect(Dialect):
    name = "responses"
    api = "openai"
    path = "/responses"
    named = raw_named = True

    def __init__(self) -> None:
        self.last_seq = -1  # the highest sequence_number read (a max: reads may repeat)
        # The relayed stream's state (_Relayed): the events held before the first output,
        # their bytes, and whether the first output went out.
        self.held: list[bytes] = []
        self.held_size = 0
        self.started = False

    def for_stream(self) -> Dialect:
        # Made per call, and not kept here: the reader refers to this dialect, and a
        # reference back would be a cycle that keeps the request's objects for the garbage
        # collector (tests/test_request_garbage.py). One stream a request reads it.
        return _Relayed(self)

    def read(
        self, data: bytes, event: str | None, raw: bytes | None, strip_usage: bool
    ) -> Piece | None:
        return self.judge(data, event, raw)[0]

    def judge(self, data: bytes, event: str | None, raw: bytes | None) -> tuple[Piece, str]:
        """The event's piece and its type."""
        if data == sse.DONE:  # not in OpenAI's API; some compatible servers end with it
            piece = Piece(sse.DONE_EVENT)
            piece.end = True
            return piece, ""
        try:
            e = _decode(data)
        except msgspec.ValidationError:
            e = _lenient(data)
        except (msgspec.DecodeError, RecursionError):
            raise sse.SSEProtocolError("upstream sent an event that is not JSON") from None
        if raw is None or event == "":  # (an empty name is not passed on: see below)
            data = data.replace(b"\n", b" ") if data.find(b"\n") >= 0 else data
            raw = (b"event: " + event.encode() + b"\ndata: " if event else b"data: ") + data
            raw += b"\n\n"
        seq = e.sequence_number
        if seq is not None and seq > self.last_seq:
            self.last_seq = seq
        kind = e.type
        if kind.endswith(".delta"):
            text = e.delta if kind == TEXT_DELTA and isinstance(e.delta, str) else ""
            piece = Piece(raw, [text])
            lp = e.logprobs
            if (
                text
                and (lp == _NO_LOGPROBS or lp is ABSENT or not says_something(lp))
                and e.output_index is not None
                and e.content_index is not None
            ):
                piece.may_merge, piece.dialect = True, self
                out, part = e.output_index, e.content_index
                piece.kind = (
                    _PART_KINDS[out][part] if 0 <= out < 8 and 0 <= part < 4 else f"t{out}.{part}"
                )
            return piece, kind
        piece = Piece(raw)
        if kind in _FINISHED or kind == "response.failed":
            resp = e.response
            if resp is not None:
                piece.usage = chat_usage(object_of(resp.usage))
            if kind == "response.failed":
                err = object_of(resp.error) if resp is not None else None
                piece.error = err or {"message": "response failed"}
            else:
                piece.finish_reason = _FINISHED[kind]
            piece.end = True
        elif kind == "error":
            piece.error = error_of(e)
            piece.end = True
        return piece, kind

    def template(self, raw: bytes) -> tuple[Any, str] | None:
        start = raw.find(b"data: ") + 6
        try:
            obj = orjson.loads(raw[start:-2])
            orjson.dumps(obj)  # a merged event is rebuilt from it: it must serialise
        except orjson.JSONEncodeError:
            return None
        except (orjson.JSONDecodeError, RecursionError):
            raise sse.SSEProtocolError("upstream sent an event that is not valid JSON") from None
        return obj, f"t{obj.get('output_index')}.{obj.get('content_index')}"

    def render(self, template: Any, kind: str, text: str) -> bytes:
        return render_text_delta(template, text)

    def answer(self, body: bytes, obj: dict[str, Any]) -> bytes:
        return body

    def usage_of(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        return chat_usage(obj.get("usage"))

    def error_event(self, error: GatewayError) -> bytes:
        """After what was held back, if nothing went out yet (the response's start)."""
        self.last_seq += 1
        held, self.held = self.held, []
        return b"".join(held) + encode_event(error_payload(error, self.last_seq))

    def strip_extensions(self, request: dict[str, Any]) -> bool:
        """`stream_options.max_tokens_per_second`: the pace the client renders at."""
        opts = request.get("stream_options")
        if isinstance(opts, dict) and "max_tokens_per_second" in opts:
            rest = {k: v for k, v in opts.items() if k != "max_tokens_per_second"}
            if rest:
                request["stream_options"] = rest
            else:
                del request["stream_options"]
            return True
        return False

    def wants_usage(self, request: dict[str, Any]) -> bool:
        return True  # the terminal event always carries it


#: Bytes of events held before the first output (past it they go out as they are).
HELD_MAX = 64 * 1024


class _Relayed(Dialect):
    """The relayed stream's reader (see the module docstring): the events before the first
    output are held and sent with it; a `response.created` starts the held prefix over (a
    hedge's or a retry's response taking over before content). Its state is its owner's."""

    named = raw_named = True

    def __init__(self, owner: ResponsesDialect) -> None:
        self.owner = owner

    def read(
        self, data: bytes, event: str | None, raw: bytes | None, strip_usage: bool
    ) -> Piece | None:
        o = self.owner
        piece, kind = o.judge(data, event, raw)
        if o.started:
            return piece
        if not piece.first:
            if kind == "response.created":
                o.held, o.held_size = [], 0
            assert piece.raw is not None
            o.held.append(piece.raw)
            o.held_size += len(piece.raw)
            if o.held_size <= HELD_MAX:
                return None
            o.started = True  # bounded: what was held goes out now
            piece = Piece(b"".join(o.held))
            o.held = []
            return piece
        o.started = True
        if o.held:
            assert piece.raw is not None
            piece.raw = b"".join(o.held) + piece.raw
            piece.may_merge, piece.kind, piece.template = False, "", None
            o.held = []
        return piece

    def template(self, raw: bytes) -> tuple[Any, str] | None:
        return self.owner.template(raw)

    def render(self, template: Any, kind: str, text: str) -> bytes:
        return render_text_delta(template, text)


def render_text_delta(template: dict[str, Any], text: str) -> bytes:
    """A merged `response.output_text.delta`: the first delta's event with the joined text.
    The merged deltas had sequence numbers s, s+1, ...; the event takes s and leaves s+1 to
    the rest of a piece split later (a paced reader), so numbers still increase strictly."""
    template["delta"] = text
    out = _EVENT_TEXT_DELTA + orjson.dumps(template) + b"\n\n"
    seq = template.get("sequence_number")
    if type(seq) is int:
        template["sequence_number"] = seq + 1
    return out


def _lenient(data: bytes) -> _Event:
    """An event whose fields are typed otherwise (event_json.lenient): what can be read of it
    (the rest is passed on as it came, not acted on)."""
    obj = lenient(data)
    kind, delta, resp = obj.get("type"), obj.get("delta"), obj.get("response")
    return _Event(
        type=kind if isinstance(kind, str) else "",
        delta=delta if isinstance(delta, str) else Opaque() if delta is not None else None,
        output_index=_int(obj.get("output_index")),
        content_index=_int(obj.get("content_index")),
        logprobs=_SOME if obj.get("logprobs") else ABSENT,
        sequence_number=_int(obj.get("sequence_number")),
        response=_Response(raw_object(resp.get("usage")), raw_object(resp.get("error")))
        if isinstance(resp, dict)
        else None,
        code=_str(obj.get("code")),
        message=_str(obj.get("message")),
        param=_str(obj.get("param")),
        error=raw_object(obj.get("error")),
    )


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


#: A Raw field that says something, for the lenient read of one only tested for that.
_SOME = msgspec.Raw(b"true")


RESPONSES = ResponsesDialect()
