"""An OpenAI chat client on an Anthropic upstream, in-process: the request translated (and
refused, naming the field, where Messages cannot express it), a Messages stream read into chat
chunks that the openai SDK's own types accept, merging for a slow reader, a whole answer."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tokenpipe.dialects.chat_via_messages import ChatViaMessages
from tokenpipe.dialects.messages_request import messages_request
from tokenpipe.errors import GatewayError
from tokenpipe.relay.buffer import Accumulator
from tokenpipe.relay.events import EventParser
from tokenpipe.relay.tally import StreamTally


def _event(kind: str, **fields: Any) -> bytes:
    return (
        b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"
    )


USAGE = {"input_tokens": 12, "output_tokens": 1, "cache_read_input_tokens": 5}
STREAM = [
    _event(
        "message_start",
        message={
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-x",
            "content": [],
            "stop_reason": None,
            "usage": USAGE,
        },
    ),
    _event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    _event("ping"),
    *(
        _event("content_block_delta", index=0, delta={"type": "text_delta", "text": f" w{i}"})
        for i in range(6)
    ),
    _event("content_block_stop", index=0),
    _event(
        "content_block_start",
        index=1,
        content_block={"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},
    ),
    _event(
        "content_block_delta",
        index=1,
        delta={"type": "input_json_delta", "partial_json": '{"city"'},
    ),
    _event(
        "content_block_delta",
        index=1,
        delta={"type": "input_json_delta", "partial_json": ': "Oslo"}'},
    ),
    _event("content_block_stop", index=1),
    _event("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 9}),
    _event("message_stop"),
]
CHAT = {
    "model": "claude-x",
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "d",
                "parameters": {"type": "object"},
            },
        }
    ],
    "tool_choice": "required",
    "stop": "END",
}


def _chunks(pieces: list[Any]) -> list[dict[str, Any]]:
    out = []
    for p in pieces:
        for block in p.event().split(b"\n\n"):
            if block.startswith(b"data: ") and block != b"data: [DONE]":
                out.append(orjson.loads(block[6:]))
    return out


def _read(reads: list[bytes]) -> tuple[list[Any], StreamTally]:
    tally = StreamTally("u", "m", time.perf_counter())
    parser = EventParser(tally, False, ChatViaMessages(CHAT))
    pieces = []
    for r in reads:
        pieces += parser.feed(r)
    assert parser.at_end()
    return pieces, tally


def test_the_request_is_written_as_a_messages_request() -> None:
    out = messages_request(CHAT)
    assert out["system"] == "Be brief."
    assert out["max_tokens"] == 4096  # required by Anthropic: the default when unset
    assert out["stop_sequences"] == ["END"]
    assert out["tool_choice"] == {"type": "any"}
    assert out["tools"] == [
        {"name": "get_weather", "input_schema": {"type": "object"}, "description": "d"}
    ]
    assert out["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "call_1",
                    "name": "get_weather",
                    "input": {"city": "Oslo"},
                }
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}],
        },
    ]


def test_consecutive_tool_results_join_one_user_turn_and_only_theirs() -> None:
    def call(i: int) -> dict[str, Any]:
        return {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}

    def tool(i: int) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": f"c{i}", "content": f"r{i}"}

    chat = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [call(i) for i in range(3)]},
            *[tool(i) for i in range(3)],
            {"role": "user", "content": "and then"},
            tool(3),  # after a user's text: a turn of its own
            {"role": "assistant", "content": "ok", "tool_calls": [call(4)]},
            *[tool(i) for i in range(4, 2004)],  # many: each joins without a rescan
        ],
    }
    turns = messages_request(chat)["messages"]
    ids = [
        [b.get("tool_use_id") for b in t["content"] if b["type"] == "tool_result"] for t in turns
    ]
    roles = ["user", "assistant", "user", "user", "user", "assistant", "user"]
    assert [t["role"] for t in turns] == roles
    assert ids[2] == ["c0", "c1", "c2"] and ids[4] == ["c3"]
    assert ids[6] == [f"c{i}" for i in range(4, 2004)]
    assert turns[3]["content"] == [{"type": "text", "text": "and then"}]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", True),
        ("presence_penalty", 0.5),
        ("n", 2),
        ("seed", 7),
        ("response_format", {"type": "json_object"}),
    ],
)
def test_what_messages_cannot_express_is_a_400_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(GatewayError) as e:
        messages_request({**CHAT, field: value})
    assert e.value.status == 400 and e.value.param == field


def _assistant(tool_calls: Any) -> dict[str, Any]:
    return {**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": tool_calls}]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "tools": [{"type": "function", "function": "text"}]}, "tools[0].function"),
        ({**CHAT, "tools": ["get_weather"]}, "tools"),
        ({**CHAT, "tools": {"type": "function"}}, "tools"),
        ({**CHAT, "tool_choice": {"type": "function", "function": 3}}, "tool_choice.function"),
        ({**CHAT, "stop": 5}, "stop"),
        ({**CHAT, "stop": ["a", {"b": 1}]}, "stop"),
        (_assistant("call"), "messages[0].tool_calls"),
        (_assistant([{"id": "c", "function": ["x"]}]), "messages[0].tool_calls[0].function"),
        (
            {
                **CHAT,
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}
                ],
            },
            "messages",
        ),
    ],
)
def test_a_mistyped_field_the_translation_reads_is_a_400_naming_it(
    body: dict[str, Any], param: str
) -> None:
    """Fields the front's schema leaves untyped (the upstream checks them on the native path)
    but this translation reads: found by test_fuzz_http as a 500 (`function` a string)."""
    with pytest.raises(GatewayError) as e:
        messages_request(body)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("split", [1, 7, 10_000])
def test_the_stream_becomes_chat_chunks_the_sdk_accepts(split: int) -> None:
    body = b"".join(STREAM)
    reads = [body[i : i + split] for i in range(0, len(body), split)]
    pieces, tally = _read(reads)
    chunks = _chunks(pieces)
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "".join(f" w{i}" for i in range(6))
    calls = [
        tc
        for c in chunks
        if c["choices"]
        for tc in c["choices"][0]["delta"].get("tool_calls") or ()
    ]
    assert calls[0]["id"] == "toolu_1" and calls[0]["function"]["name"] == "get_weather"
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Oslo"}'
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 17
    assert tally.usage is not None and tally.usage["completion_tokens"] == 9
    assert tally.usage["prompt_tokens_details"] == {"cached_tokens": 5}
    assert pieces[-1].event().endswith(b"data: [DONE]\n\n") and tally.done


def test_a_slow_reader_gets_the_text_deltas_merged_with_the_same_text() -> None:
    pieces, _ = _read([b"".join(STREAM)])
    acc = Accumulator()
    for p in pieces:
        acc.put(p)
    out, _ = acc.take(1 << 30)
    chunks = _chunks(out)
    texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert "".join(t or "" for t in texts) == "".join(f" w{i}" for i in range(6))
    assert " w0 w1 w2 w3 w4 w5" in texts  # one event for the six deltas
    for c in chunks:
        ChatCompletionChunk.model_validate(c)


def test_a_whole_message_becomes_a_chat_completion() -> None:
    message = {
        "id": "msg_2",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [
            {"type": "text", "text": "It is "},
            {"type": "tool_use", "id": "toolu_2", "name": "f", "input": {"a": 1}},
        ],
        "stop_reason": "max_tokens",
        "usage": {"input_tokens": 3, "output_tokens": 4},
    }
    dialect = ChatViaMessages({**CHAT, "stream": False})
    body = dialect.answer(orjson.dumps(message), message)
    done = ChatCompletion.model_validate_json(body)
    assert done.choices[0].message.content == "It is "
    assert done.choices[0].finish_reason == "length"
    assert done.choices[0].message.tool_calls is not None
    assert done.usage is not None and done.usage.completion_tokens == 4
    err = dialect.upstream_error_body(
        529, {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    )
    assert err is not None and orjson.loads(err)["error"]["type"] == "overloaded_error"


def test_hostile_usage_counts_are_read_as_absent_not_crashed_on() -> None:
    bad = {"input_tokens": "12", "output_tokens": True, "cache_read_input_tokens": 1e400}
    stream = [
        _event("message_start", message={"id": "m", "model": "claude-x", "usage": bad}),
        _event("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": -3}),
        _event("message_stop"),
    ]
    _, tally = _read([b"".join(stream)])
    assert tally.usage is not None and tally.usage["prompt_tokens"] == 0
    assert tally.usage["completion_tokens"] == 0


def test_a_text_chunk_is_the_bytes_its_dict_serialises_to_for_each_message() -> None:
    """A text delta's chunk is written from head bytes made at the message's first (the
    dialect's `_text_head`) and the text's JSON: the bytes the chunk's dict serialises to,
    escapes and non-ASCII included, in the keys' order the SDKs see elsewhere; a second
    `message_start` (another id and model) makes the head again."""
    d = ChatViaMessages({"model": "m", "messages": []}).for_stream()
    texts = ['a "q"', "\\\n\t\x01", "é😀"]
    seen = []
    for msg_id, model in (("msg_1", "claude-x"), ("msg_2", 'c-"content":"y"')):
        start = {"type": "message_start", "message": {"id": msg_id, "model": model}}
        d.read(orjson.dumps(start), "message_start", None, True)
        for text in texts:
            delta = {"type": "content_block_delta", "index": 0}
            data = orjson.dumps({**delta, "delta": {"type": "text_delta", "text": text}})
            piece = d.read(data, "content_block_delta", None, True)
            assert piece is not None and piece.raw is not None and piece.may_merge
            obj = orjson.loads(piece.raw[6:])
            assert piece.raw == b"data: " + orjson.dumps(obj) + b"\n\n"
            assert list(obj) == ["id", "object", "created", "model", "choices"]
            assert list(obj["choices"][0]) == ["index", "delta", "logprobs", "finish_reason"]
            ChatCompletionChunk.model_validate(obj)
            seen.append((obj["id"], obj["model"], obj["choices"][0]["delta"]["content"]))
    assert seen == [("chatcmpl-msg_1", "claude-x", t) for t in texts] + [
        ("chatcmpl-msg_2", 'c-"content":"y"', t) for t in texts
    ]
