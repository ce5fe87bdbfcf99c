"""An Anthropic Messages client on an OpenAI chat upstream, in-process: the request translated
(and refused, naming the field, where chat cannot express it), a chat stream read into
Messages events that the anthropic SDK's own types accept, merging for a slow reader, a whole
answer and errors in Anthropic's shape."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from tokenpipe import sse
from tokenpipe.dialects.chat_request import chat_request
from tokenpipe.dialects.messages_via_chat import MessagesViaChat
from tokenpipe.errors import GatewayError
from tokenpipe.relay.buffer import Accumulator
from tokenpipe.relay.events import EventParser
from tokenpipe.relay.tally import StreamTally

EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)


def _chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    obj = {"id": "c1", "object": "chat.completion.chunk", "model": "gpt-x", "choices": choices}
    return sse.encode(orjson.dumps({**obj, **extra}))


STREAM = [
    _chunk({"role": "assistant", "content": ""}),
    *(_chunk({"content": f" w{i}"}) for i in range(6)),
    _chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        }
    ),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}),
    _chunk({}, "tool_calls"),
    _chunk(
        None,
        usage={
            "prompt_tokens": 20,
            "completion_tokens": 9,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    ),
    sse.DONE_EVENT,
]
REQUEST = {
    "model": "gpt-x",
    "max_tokens": 100,
    "stream": True,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Oslo"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ],
    "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    "stop_sequences": ["END"],
}


def _events(pieces: list[Any]) -> list[dict[str, Any]]:
    out = []
    for p in pieces:
        for block in p.event().split(b"\n\n"):
            if block:
                data = block.split(b"\ndata: ", 1)[1]
                out.append(EVENTS.validate_json(data).model_dump())
    return out


def _read(reads: list[bytes]) -> tuple[list[Any], StreamTally]:
    tally = StreamTally("u", "m", time.perf_counter())
    parser = EventParser(tally, False, MessagesViaChat(REQUEST))
    pieces = []
    for r in reads:
        pieces += parser.feed(r)
    assert parser.at_end()
    return pieces, tally


def test_the_request_is_written_as_a_chat_request() -> None:
    out = chat_request(REQUEST)
    assert out["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    assert out["tool_choice"] == "required" and out["parallel_tool_calls"] is False
    assert out["stream_options"] == {"include_usage": True}
    assert out["stop"] == ["END"] and out["max_tokens"] == 100


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 5),
        ("thinking", {"type": "enabled", "budget_tokens": 1024}),
        # Not a choice chat has; an unhashable type was a 500 (the fuzz tests, at 10x).
        ("tool_choice", {"type": 5}),
        ("tool_choice", {"type": []}),
        ("tool_choice", {"type": {}}),
    ],
)
def test_what_chat_cannot_express_is_a_400_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(GatewayError) as e:
        chat_request({**REQUEST, field: value})
    assert e.value.status == 400 and e.value.param == field


@pytest.mark.parametrize("content", [5, True, 1.5])
def test_a_tool_result_whose_content_is_not_text_or_blocks_is_a_400(content: Any) -> None:
    result = {"type": "tool_result", "tool_use_id": "t1", "content": content}
    body = {**REQUEST, "messages": [{"role": "user", "content": [result]}]}
    with pytest.raises(GatewayError) as e:  # was a 500: an int is not iterable
        chat_request(body)
    assert e.value.status == 400 and e.value.param == "messages"


@pytest.mark.parametrize("source", ["https://example.com/a.png", None, 7])
def test_an_image_source_that_is_not_an_object_is_a_400(source: Any) -> None:
    image = {"type": "image", "source": source}
    body = {**REQUEST, "messages": [{"role": "user", "content": [image]}]}
    with pytest.raises(GatewayError) as e:
        chat_request(body)
    assert e.value.status == 400 and e.value.param == "messages"


@pytest.mark.parametrize("split", [1, 9, 10_000])
def test_the_stream_becomes_messages_events_the_sdk_accepts(split: int) -> None:
    body = b"".join(STREAM)
    pieces, tally = _read([body[i : i + split] for i in range(0, len(body), split)])
    events = _events(pieces)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    text = "".join(
        e["delta"]["text"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
    )
    assert text == "".join(f" w{i}" for i in range(6))
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"]
    assert starts[1]["id"] == "call_1" and starts[1]["name"] == "get_weather"
    args = "".join(
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    )
    assert orjson.loads(args) == {"city": "Oslo"}
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    end = events[-2]
    assert end["delta"]["stop_reason"] == "tool_use"
    assert end["usage"]["output_tokens"] == 9 and end["usage"]["input_tokens"] == 12
    assert tally.usage is not None and tally.usage["completion_tokens"] == 9 and tally.done
    assert tally.finished  # the chat finish's piece carried it (the relay's books)


def test_one_delta_of_many_tool_calls_becomes_their_blocks_in_order() -> None:
    calls = [
        {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": f"f{i}"}}
        for i in range(2000)
    ] + [{"index": i, "function": {"arguments": f'{{"n": {i}}}'}} for i in range(2000)]
    head = _chunk({"role": "assistant", "content": "a"})
    stream = [head, _chunk({"tool_calls": calls}), _chunk({}, "tool_calls"), sse.DONE_EVENT]
    events = _events(_read([b"".join(stream)])[0])
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [e["content_block"].get("id") for e in starts[1:]] == [f"call_{i}" for i in range(2000)]
    args = [e for e in events if e["type"] == "content_block_delta"][1:]
    assert [(e["index"], e["delta"]["partial_json"]) for e in args] == [
        (i + 1, f'{{"n": {i}}}') for i in range(2000)
    ]
    ends = [e["type"] for e in events]
    assert ends.count("content_block_start") == ends.count("content_block_stop") == 2001


def test_a_slow_reader_gets_the_text_deltas_merged_with_the_same_text() -> None:
    pieces, _ = _read([b"".join(STREAM)])
    acc = Accumulator()
    for p in pieces:
        acc.put(p)
    out, _ = acc.take(1 << 30)
    events = _events(out)
    texts = [
        e["delta"]["text"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
    ]
    assert "".join(texts) == "".join(f" w{i}" for i in range(6))
    assert " w1 w2 w3 w4 w5" in texts  # the first opens the block; the rest is one event


def test_a_whole_chat_completion_becomes_a_message_and_errors_take_anthropics_shape() -> None:
    completion = {
        "id": "c2",
        "object": "chat.completion",
        "model": "gpt-x",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "message": {
                    "role": "assistant",
                    "content": "It is ",
                    "tool_calls": [
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"a": 1}'},
                        }
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }
    dialect = MessagesViaChat({**REQUEST, "stream": False})
    message = Message.model_validate_json(dialect.answer(orjson.dumps(completion), completion))
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4
    assert [b.type for b in message.content] == ["text", "tool_use"]
    err = orjson.loads(dialect.upstream_error_body(429, {"error": {"message": "slow down"}}) or b"")
    assert err == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    event = dialect.error_event(GatewayError(504, "too slow"))
    assert event.startswith(b"event: error\n")
    shape = ErrorResponse.model_validate_json(event.split(b"\ndata: ", 1)[1])
    assert shape.error.type == "timeout_error" and shape.error.message == "too slow"


def test_a_text_delta_is_the_bytes_its_events_dict_serialises_to() -> None:
    """Text deltas are written from a block's head bytes and the text's JSON
    (messages_via_chat._text_head): the same bytes as the event's dict through orjson, for
    the blocks whose heads are made once (below 16) and those made on the spot, escapes and
    non-ASCII included; each token of a block that goes on is its own event, free to merge."""
    texts = ['a "q"', "\\\n\t\x01", "é😀", "z"]
    calls = [
        {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": "f"}}
        for i in range(16)
    ]  # blocks 1-16 after the first text's: the next text opens block 17 (a head made then)
    d = MessagesViaChat({"model": "m", "max_tokens": 5, "messages": []}).for_stream()
    seen: list[tuple[int, str]] = []
    for round_ in range(2):
        if round_:
            assert d.read(_chunk({"tool_calls": calls})[6:-2], None, None, True) is not None
        for n, text in enumerate(texts):
            piece = d.read(_chunk({"content": text})[6:-2], None, None, True)
            assert piece is not None and piece.raw is not None
            assert piece.may_merge == (n > 0)
            last = piece.raw[piece.raw.rfind(b"event: ") :]
            obj = orjson.loads(last[last.index(b"data: ") + 6 :])
            assert last == b"event: content_block_delta\ndata: " + orjson.dumps(obj) + b"\n\n"
            assert list(obj) == ["type", "index", "delta"] and list(obj["delta"]) == [
                "type",
                "text",
            ]
            seen.append((obj["index"], obj["delta"]["text"]))
    assert seen == [(0, t) for t in texts] + [(17, t) for t in texts]


def test_chunks_of_other_shapes_while_a_text_block_is_open_take_the_general_path() -> None:
    """The usual token has a path of its own (one text delta of the open text block); a
    chunk of any other shape then is read as before: not crashed on, its finish, usage and
    other deltas kept."""
    d = MessagesViaChat({"model": "m", "max_tokens": 5, "messages": []}).for_stream()

    def read(obj: dict[str, Any]) -> Any:
        return d.read(orjson.dumps({"id": "c1", **obj}), None, None, True)

    assert read({"choices": [{"delta": {"content": "a"}}]}) is not None  # opens the block
    for odd in (["x"], [{"delta": "x"}], [{"delta": {"content": 5}}], [1, 2], "x"):
        assert read({"choices": odd}) is None
    done = read({"choices": [{"delta": {"content": "b"}, "finish_reason": "stop"}]})
    assert done.finish_reason == "stop" and done.parts == ["b"]
    counted = read({"choices": [{"delta": {"content": "c"}}], "usage": {"prompt_tokens": 1}})
    assert counted.usage == {"prompt_tokens": 1} and counted.parts == ["c"]
    thought = read({"choices": [{"delta": {"content": "d", "reasoning_content": "r"}}]})
    events = _events([thought])
    assert [e["type"] for e in events] == [
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
    ]
