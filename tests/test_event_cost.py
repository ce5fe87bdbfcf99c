"""What an upstream's event costs the gateway: the objects of the fields its reader reads, not
the objects the upstream wrote (dialects/event_json.py).

Every reader of upstream events, native and translated, is fed one event of ~4 MiB whose junk
(a `[]` for every 3 bytes) sits where that reader once built it into Python objects: an
unread field, a field only tested for presence (`logprobs`, `tool_calls`), an object read
whole (`usage`). Built, the junk was 22-34x the event's bytes at the peak (and 145-240 ms of
the event loop, benchmarks/hostile_cost.py `event:`); skipped, the peak is the event's
copies (SSE framing), at most 4x. The peak is what the test reads: memory is deterministic
where time is not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest

from tests.traced import peak_bytes
from tokenpipe import sse
from tokenpipe.dialects.anthropic import MESSAGES
from tokenpipe.dialects.base import Dialect, Piece
from tokenpipe.dialects.chat_via_messages import ChatViaMessages
from tokenpipe.dialects.event_json import MAX_LENIENT_BYTES, MAX_TEMPLATE_BYTES
from tokenpipe.dialects.messages_via_chat import MessagesViaChat
from tokenpipe.dialects.openai import CHAT
from tokenpipe.dialects.responses import RESPONSES
from tokenpipe.dialects.responses_chat import ResponsesViaChat
from tokenpipe.relay.events import EventParser
from tokenpipe.relay.tally import StreamTally

JUNK = b"[" + b",".join([b"[]"] * ((4 << 20) // 3)) + b"]"
#: Peak traced memory while reading, in units of the event's size (see the module).
PEAK_MAX = 8
_REQUEST = {
    "model": "m",
    "max_tokens": 10,
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
}


def _chat(where: str) -> bytes:
    choice = b'{"index":0,"delta":{"content":"hi"},"finish_reason":null}'
    if where == "logprobs":
        choice = choice[:-1] + b',"logprobs":{"content":' + JUNK + b"}}"
    elif where == "tool_calls":
        call = b'{"index":0,"function":{"name":"f","arguments":"{}"},"x":' + JUNK + b"}"
        choice = b'{"index":0,"delta":{"tool_calls":[' + call + b']},"finish_reason":null}'
    elif where == "delta":
        choice = b'{"index":0,"delta":{"content":"hi","x":' + JUNK + b'},"finish_reason":null}'
    chunk = b'{"id":"c","object":"chat.completion.chunk","model":"m","choices":[' + choice + b"]"
    if where == "unread":
        chunk += b',"x":' + JUNK
    elif where == "usage":
        chunk += b',"usage":{"prompt_tokens":1,"x":' + JUNK + b"}"
    return b"data: " + chunk + b"}\n\n"


def _messages(where: str) -> bytes:
    if where == "usage":
        data = b'{"type":"message_delta","delta":{"stop_reason":null},"usage":{"x":' + JUNK
        return b"event: message_delta\ndata: " + data + b"}}\n\n"
    data = b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"'
    data += b',"x":' + JUNK + b"}}" if where == "delta" else b'},"x":' + JUNK + b"}"
    return b"event: content_block_delta\ndata: " + data + b"\n\n"


def _responses(where: str) -> bytes:
    data = b'{"type":"response.output_text.delta","item_id":"i","output_index":0,'
    data += b'"content_index":0,"delta":"hi","sequence_number":3,'
    data += (b'"logprobs":' if where == "logprobs" else b'"x":') + JUNK + b"}"
    return b"event: response.output_text.delta\ndata: " + data + b"\n\n"


#: Reader -> (its dialect for one stream, the event maker, the junk's places).
READERS: dict[str, tuple[Callable[[], Dialect], Callable[[str], bytes], tuple[str, ...]]] = {
    "chat": (lambda: CHAT, _chat, ("unread", "delta", "logprobs", "usage", "tool_calls")),
    "messages via chat": (
        lambda: MessagesViaChat(_REQUEST).for_stream(),
        _chat,
        ("unread", "delta", "logprobs", "usage", "tool_calls"),
    ),
    "responses via chat": (
        lambda: ResponsesViaChat({"model": "m", "input": "hi", "stream": True}).for_stream(),
        _chat,
        ("unread", "delta", "logprobs", "usage", "tool_calls"),
    ),
    "messages": (lambda: MESSAGES.for_stream(), _messages, ("unread", "delta", "usage")),
    "chat via messages": (
        lambda: ChatViaMessages(_REQUEST).for_stream(),
        _messages,
        ("unread", "delta", "usage"),
    ),
    "responses": (lambda: RESPONSES.for_stream(), _responses, ("unread", "logprobs")),
}
CASES = [(reader, where) for reader, (_, _, places) in READERS.items() for where in places]


def _parser(dialect: Dialect) -> EventParser:
    return EventParser(StreamTally("u", "m", 0.0), False, dialect)


@pytest.mark.parametrize(("reader", "where"), CASES)
def test_an_event_costs_its_bytes_not_its_junk(reader: str, where: str) -> None:
    make, event, _ = READERS[reader]
    body = event(where)
    parser = _parser(make())
    pieces, peak = peak_bytes(lambda: parser.feed(body))
    assert peak < PEAK_MAX * len(body), f"{peak / len(body):.1f}x the event"
    assert parser.fault is None
    [piece] = pieces  # read, and passed on
    if where == "usage":  # an object over answer_fields.MAX_VALUE_BYTES is not read
        assert not (piece.usage or {}).get("completion_tokens"), piece.usage
    else:
        assert piece.parts == (["hi"] if where != "tool_calls" else [""]), piece.parts


def _big_text_chunk(extra: bytes = b"") -> bytes:
    text = orjson.dumps("x" * (MAX_LENIENT_BYTES + 10))
    delta = b'{"content":' + text + extra + b"}"
    return b'{"id":"c","choices":[{"index":0,"delta":' + delta + b',"finish_reason":null}]}'


@pytest.mark.parametrize(
    "make",
    [
        lambda: CHAT,
        lambda: MessagesViaChat(_REQUEST).for_stream(),
        lambda: ResponsesViaChat({"model": "m", "input": "hi", "stream": True}).for_stream(),
    ],
)
def test_a_large_event_of_another_shape_is_a_protocol_error(make: Callable[[], Dialect]) -> None:
    """Past MAX_LENIENT_BYTES an event is read only in its API's shape: a field of another
    type there ends the stream with the protocol error, naming the size; below, it is read
    leniently (tests/test_hostile_shapes.py)."""
    data = _big_text_chunk(b',"reasoning":5')
    with pytest.raises(sse.SSEProtocolError, match=f"event of {len(data)} bytes"):
        make().read(data, None, None, False)
    small = b'{"id":"c","choices":[{"index":0,"delta":{"content":"hi","reasoning":5}}]}'
    piece = make().read(small, None, None, False)
    assert piece is not None and piece.parts == ["hi"]


def _merged(dialect: Dialect, data: bytes) -> bool:
    piece = dialect.read(data, None, b"data: " + data + b"\n\n", False)
    assert piece is not None and piece.may_merge
    return piece.mergeable()


def test_a_large_content_delta_is_passed_on_unmerged() -> None:
    """A behind client's deltas merge into an event rebuilt from the first one's JSON, parsed
    whole; past MAX_TEMPLATE_BYTES it is not parsed and the delta goes out as it came."""
    assert _merged(CHAT, b'{"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}')
    large = _big_text_chunk()
    assert len(large) > MAX_TEMPLATE_BYTES
    assert not _merged(CHAT, large)


def test_a_spaced_null_usage_is_cut_from_the_bytes() -> None:
    """`"usage": null` as Python's json.dumps writes it (the gateway asked for the usage, the
    client did not) is cut from the event's bytes, the rest passed on as the upstream wrote
    it, not parsed and written again."""
    data = b'{"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": null}'
    piece: Piece | None = CHAT.read(data, None, b"data: " + data + b"\n\n", True)
    assert piece is not None
    want = b'{"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]}'
    assert piece.raw == b"data: " + want + b"\n\n"


def test_usage_and_errors_read_as_before() -> None:
    """The objects read from Raw fields: a usage chunk's counts and an error event."""
    usage = b'{"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
    piece = CHAT.read(usage, None, None, False)
    assert piece is not None and piece.usage == {"prompt_tokens": 3, "completion_tokens": 2}
    error = CHAT.read(b'{"error":{"message":"boom"}}', None, None, False)
    assert error is not None and error.error == {"message": "boom"} and error.end
    not_object = CHAT.read(b'{"choices":[],"usage":[1]}', None, None, False)
    assert not_object is not None and not_object.usage is None
    tool = b'{"choices":[{"delta":{"tool_calls":[]}}]}'  # empty: no content
    assert CHAT.read(tool, None, None, False).parts is None  # type: ignore[union-attr]
    anthropic: Any = MESSAGES.for_stream()
    start = b'{"type":"message_start","message":{"usage":{"input_tokens":5}}}'
    assert anthropic.read(start, "message_start", None, False).usage == {"prompt_tokens": 5}


# -- non-streamed answers, which a translation reads whole (Dialect.parse_answer) --------------


def _completion(where: str) -> bytes:
    args = b'"{\\"n\\":1}"'
    if where == "tool":  # the arguments: a JSON string holding 4 MiB of JSON
        args = orjson.dumps(b'{"x":'.decode() + JUNK.decode() + "}")
    message = b'{"role":"assistant","content":"hi","tool_calls":[{"id":"t","type":"function",'
    message += b'"function":{"name":"f","arguments":' + args + b"}}]}"
    body = b'{"id":"c","model":"m","choices":[{"index":0,"message":' + message
    body += b',"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":1,"completion_tokens":2}'
    return body + (b',"x":' + JUNK if where == "unread" else b"") + b"}"


def _message(where: str) -> bytes:
    tool_input = b'{"x":' + JUNK + b"}" if where == "tool" else b'{"n":1}'
    content = b'[{"type":"text","text":"hi"},{"type":"tool_use","id":"t","name":"f","input":'
    body = b'{"id":"m","model":"m","content":' + content + tool_input + b"}]"
    body += b',"stop_reason":"tool_use","usage":{"input_tokens":1,"output_tokens":2}'
    return body + (b',"x":' + JUNK if where == "unread" else b"") + b"}"


ANSWERS: dict[str, tuple[Callable[[], Dialect], Callable[[str], bytes]]] = {
    "messages via chat": (lambda: MessagesViaChat(_REQUEST), _completion),
    "responses via chat": (lambda: ResponsesViaChat({"model": "m", "input": "hi"}), _completion),
    "chat via messages": (lambda: ChatViaMessages(_REQUEST), _message),
}


def _tool_json(reader: str, out: dict[str, Any]) -> Any:
    """The tool call's arguments or input in the client's answer, parsed."""
    if reader == "messages via chat":
        return out["content"][1]["input"]
    if reader == "responses via chat":
        return orjson.loads(out["output"][1]["arguments"])
    return orjson.loads(out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])


def _translate(dialect: Dialect, body: bytes) -> tuple[Any, bytes]:
    """The answer as the translation reads it, and as it writes it for the client."""
    obj = dialect.parse_answer(body)
    return obj, dialect.answer(body, obj)


@pytest.mark.parametrize("where", ["unread", "tool"])
@pytest.mark.parametrize("reader", list(ANSWERS))
def test_an_answer_costs_its_bytes_not_its_junk(reader: str, where: str) -> None:
    """An unread field is skipped, not built (the peak was 33x the answer); a tool's input
    or arguments are checked as JSON and written as they came (85x: built, then written).
    Written, 4 MiB of arguments still peak at ~16x in orjson, which reserves room for the
    worst escapes of a string it writes (the responses translation's peak, before and
    after)."""
    make, answer = ANSWERS[reader]
    body = answer(where)
    dialect = make()
    (obj, written), peak = peak_bytes(lambda: _translate(dialect, body))
    out = orjson.loads(written)
    limit = 1 if where == "unread" else 24
    assert peak < limit * len(body), f"{peak / len(body):.1f}x the answer"
    usage = dialect.usage_of(obj)
    assert usage is not None and usage["prompt_tokens"] == 1, usage
    tool = _tool_json(reader, out)
    assert tool == ({"n": 1} if where == "unread" else {"x": orjson.loads(JUNK)})


def test_a_large_answer_of_another_shape_is_a_protocol_error() -> None:
    """Past MAX_LENIENT_BYTES an answer is read only in its API's shape (the front makes the
    error a 502 `upstream_protocol_error`); below, the translation judges it whole."""
    text = orjson.dumps("x" * MAX_LENIENT_BYTES)
    large = b'{"choices":[{"message":{"content":' + text + b',"reasoning":5}}]}'
    with pytest.raises(sse.SSEProtocolError, match=f"answer of {len(large)} bytes"):
        MessagesViaChat(_REQUEST).parse_answer(large)
    small = MessagesViaChat(_REQUEST).parse_answer(b'{"choices":5}')
    assert small == {"choices": 5}
    assert MessagesViaChat(_REQUEST).parse_answer(b"not json") is None
