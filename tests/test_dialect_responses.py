"""The Responses dialects and the request translation, without sockets: what each event
becomes, how deltas merge and split for slow readers (sequence numbers still increase), the
held start of a native stream, and what chat cannot express."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.responses_events import check_events, check_response, parse, text_of
from tokenpipe import sse
from tokenpipe.control import cost
from tokenpipe.dialects import Piece
from tokenpipe.dialects.openai_schema import parse as parse_request
from tokenpipe.dialects.responses import TEXT_DELTA, ResponsesDialect, encode_event
from tokenpipe.dialects.responses_chat import ResponsesViaChat
from tokenpipe.dialects.responses_output import HELD_MAX_BYTES, ITEM_BYTES, OutputItem
from tokenpipe.dialects.responses_request import ResponsesRequest, to_chat
from tokenpipe.errors import GatewayError
from tokenpipe.relay.events import EventParser
from tokenpipe.relay.tally import StreamTally

REQUEST = {"model": "m", "input": "hi", "instructions": "be brief"}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return orjson.dumps({"id": "c1", "model": "m", "choices": [choice]})


USAGE = orjson.dumps(
    {"id": "c1", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
)


def _read(dialect: Any, chunks: list[bytes]) -> list[Piece | None]:
    reader = dialect.for_stream()
    return [reader.read(c, None, None, True) for c in chunks]


def _bytes(pieces: list[Piece | None]) -> bytes:
    return b"".join(p.event() for p in pieces if p is not None and not p.hidden)


def test_chat_chunks_become_a_whole_valid_responses_stream() -> None:
    d = ResponsesViaChat(REQUEST)
    pieces = _read(
        d,
        [
            _chunk({"role": "assistant", "content": ""}),
            _chunk({"content": "Hel"}),
            _chunk({"content": "lo"}),
            _chunk({}, "stop"),
            USAGE,
            b"[DONE]",
        ],
    )
    assert pieces[0] is None  # a role chunk carries nothing: the start goes with content
    assert pieces[1] is not None and pieces[1].count == 1 and not pieces[1].mergeable()
    assert pieces[2] is not None and pieces[2].mergeable()  # a plain delta merges
    assert pieces[4] is not None and pieces[4].hidden and pieces[4].usage
    end = pieces[5]
    assert end is not None and end.end and end.usage == {"prompt_tokens": 7, "completion_tokens": 3}
    events = parse(_bytes(pieces))
    check_events(events)
    assert text_of(events) == "Hello"
    final = check_response(events[-1]["response"])
    assert final.status == "completed" and final.output_text == "Hello"
    assert final.instructions == "be brief" and final.usage and final.usage.input_tokens == 7


def test_merged_and_split_deltas_keep_sequence_numbers_increasing() -> None:
    d = ResponsesViaChat(REQUEST)
    chunks = [_chunk({"content": w}) for w in ("a", "b", "c", "d")]
    pieces = _read(d, [*chunks, _chunk({}, "stop"), b"[DONE]"])
    first, rest, tail = pieces[0], pieces[1:4], pieces[4:]
    assert first is not None and all(p is not None for p in rest)
    head = rest[0]
    assert head is not None
    for p in rest[1:]:
        assert p is not None and head.join(p)
    split = head.split(1)  # a paced reader takes one token, then the rest
    events = parse(_bytes([first, split, head, *tail]))
    check_events(events)
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == [
        "a",
        "b",
        "cd",
    ]


def test_tool_calls_and_reasoning_become_their_items() -> None:
    d = ResponsesViaChat({**REQUEST, "tools": [{"type": "function", "name": "f"}]})
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    pieces = _read(
        d,
        [
            _chunk({"reasoning_content": "think"}),
            _chunk({"content": "ok"}),
            _chunk({"tool_calls": [{**call, "function": {"name": "f", "arguments": '{"a"'}}]}),
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
            _chunk({}, "tool_calls"),
            b"[DONE]",
        ],
    )
    events = parse(_bytes(pieces))
    check_events(events)
    output = check_response(events[-1]["response"]).output
    assert [o.type for o in output] == ["reasoning", "message", "function_call"]
    fc = output[2]
    assert fc.type == "function_call" and fc.arguments == '{"a": 1}' and fc.call_id == "call_1"
    assert any(e["type"] == "response.reasoning_text.delta" for e in events)


def test_a_length_finish_is_an_incomplete_response() -> None:
    d = ResponsesViaChat(REQUEST)
    events = parse(_bytes(_read(d, [_chunk({"content": "x"}), _chunk({}, "length"), b"[DONE]"])))
    check_events(events)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_the_gateways_error_before_any_output_still_starts_the_response() -> None:
    d = ResponsesViaChat(REQUEST)
    events = parse(d.error_event(GatewayError(504, "too slow", code="upstream_timeout")))
    check_events(events)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]


_BIG = "a" * 65536


def _call(index: int, args: str = "") -> bytes:
    return _chunk(
        {"tool_calls": [{"index": index, "id": "c", "function": {"name": "f", "arguments": args}}]}
    )


@pytest.mark.parametrize(
    "chunks",
    [
        [_chunk({"content": _BIG})] * 70,
        [_chunk({"reasoning_content": _BIG})] * 70,
        [_call(0, _BIG)] * 70,
        [_call(i) for i in range(HELD_MAX_BYTES // ITEM_BYTES + 10)],  # items, no text
        # The read that passes the bound also opens the message: none of its events go out.
        [_chunk({"reasoning_content": _BIG})] * 63 + [_chunk({"content": _BIG})],
        [_chunk({"content": '"\n\x01' * 16384})] * 30,  # 1.5M characters, 4.7 MiB as JSON
    ],
    ids=["text", "reasoning", "arguments", "items", "opening", "escaped"],
)
def test_a_translated_stream_ends_at_its_bound_with_the_error_next_in_sequence(
    chunks: list[bytes],
) -> None:
    """What a translated stream holds for its last events (every item's text, arguments and
    reasoning, and each item) is bounded: past HELD_MAX_BYTES the read is a protocol error
    (the relay then writes the error event), and the error event's number follows the last
    event the client got."""
    d = ResponsesViaChat(REQUEST)
    reader = d.for_stream()
    out = []
    with pytest.raises(sse.SSEProtocolError, match=f"passed {HELD_MAX_BYTES} bytes"):
        for c in [*chunks, _chunk({}, "stop"), b"[DONE]"]:
            piece = reader.read(c, None, None, False)
            if piece is not None and not piece.hidden:
                out.append(piece.event())
    events = parse(b"".join(out) + d.error_event(GatewayError(502, "cut", code="x")))
    check_events(events, schema_too=False)  # (the SDK's types: faster on 4 MiB)
    assert events[-1]["type"] == "error"
    assert events[-1]["sequence_number"] == events[-2]["sequence_number"] + 1
    held = sum(len(orjson.dumps(e.get("delta", ""))) - 2 for e in events)
    assert held <= HELD_MAX_BYTES


def test_a_chat_completion_becomes_a_response() -> None:
    d = ResponsesViaChat(REQUEST)
    message = {
        "role": "assistant",
        "content": "hello",
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    body = {
        "id": "x",
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    }
    r = check_response(orjson.loads(d.answer(orjson.dumps(body), body)))
    assert r.output_text == "hello" and [o.type for o in r.output] == ["message", "function_call"]
    assert r.usage is not None and (r.usage.input_tokens, r.usage.output_tokens) == (4, 2)


def _native(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj)


def test_a_native_stream_holds_its_start_until_output_and_starts_over_at_a_new_response() -> None:
    d = ResponsesDialect()
    reader = d.for_stream()
    created = {"type": "response.created", "sequence_number": 0, "response": {"id": "r1"}}
    assert reader.read(_native(created), "response.created", None, False) is None
    # A hedge took over before content: its own response starts the held prefix over.
    again = {**created, "response": {"id": "r2"}}
    assert reader.read(_native(again), "response.created", None, False) is None
    delta = {
        "type": "response.output_text.delta",
        "output_index": 0,
        "content_index": 0,
        "delta": "Hi",
        "sequence_number": 1,
        "logprobs": [],
    }
    piece = reader.read(_native(delta), "response.output_text.delta", None, False)
    assert piece is not None and piece.count == 1 and not piece.mergeable()
    assert b'"r2"' in piece.event() and b'"r1"' not in piece.event()
    nxt = reader.read(_native({**delta, "sequence_number": 2}), None, None, False)
    assert nxt is not None and nxt.mergeable() and nxt.text == "Hi"
    completed = {
        "type": "response.completed",
        "sequence_number": 3,
        "response": {"usage": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}},
    }
    end = reader.read(_native(completed), "response.completed", None, False)
    assert end is not None and end.end and end.finish_reason == "stop"
    assert end.usage == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    error = parse(d.error_event(GatewayError(502, "cut")))[0]
    assert error["type"] == "error" and error["sequence_number"] == 4


def test_native_deltas_merge_only_within_one_content_part() -> None:
    d = ResponsesDialect()
    reader = d.for_stream()

    def delta(index: int, text: str, seq: int, part: int = 0) -> Piece:
        obj = {
            "type": "response.output_text.delta",
            "item_id": f"m{index}",
            "output_index": index,
            "content_index": part,
            "delta": text,
            "sequence_number": seq,
            "logprobs": [],
        }
        piece = reader.read(_native(obj), "response.output_text.delta", None, False)
        assert piece is not None
        return piece

    reader.read(_native({"type": "response.created", "response": {}}), None, None, False)
    delta(0, "first", 1)  # the start goes with the first output
    a, b, c = delta(0, "x", 2), delta(0, "y", 3), delta(1, "z", 4)
    assert a.join(b) and not a.join(c)
    # Past the parts whose kinds are made once too (output 8 on, content 4 on).
    for far in ((9, 0), (0, 5), (12, 7)):
        x, y = delta(far[0], "x", 5, far[1]), delta(far[0], "y", 6, far[1])
        assert x.join(y) and not x.join(delta(far[0] + 1, "z", 7, far[1]))
        assert not delta(far[0], "x", 8, far[1] + 1).join(delta(far[0], "y", 9, far[1]))
    merged = parse(a.event())[0]
    assert (merged["delta"], merged["sequence_number"], merged["item_id"]) == ("xy", 2, "m0")
    fc = reader.read(
        _native(
            {"type": "response.function_call_arguments.delta", "delta": "{", "output_index": 2}
        ),
        None,
        None,
        False,
    )
    assert fc is not None and fc.count == 1 and fc.text == "" and not fc.mergeable()


def test_input_items_become_chat_messages() -> None:
    chat = to_chat(
        {
            "model": "m",
            "instructions": "sys",
            "max_output_tokens": 9,
            "input": [
                {"role": "developer", "content": "dev"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "look"},
                        {"type": "input_image", "image_url": "https://x/y.png"},
                    ],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {}, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {}}},
            "reasoning": {"effort": "low"},
        }
    )
    msgs = chat["messages"]
    assert [m["role"] for m in msgs] == ["system", "system", "user", "assistant", "tool"]
    # One text part is that text; an output_text part as well (the assistant's own turn).
    for kind in ("input_text", "output_text"):
        one = to_chat(
            {"model": "m", "input": [{"role": "user", "content": [{"type": kind, "text": "t"}]}]}
        )
        assert one["messages"] == [{"role": "user", "content": "t"}]
    assert msgs[2]["content"][1] == {"type": "image_url", "image_url": {"url": "https://x/y.png"}}
    assert [c["id"] for c in msgs[3]["tool_calls"]] == ["c1", "c2"]  # one turn's calls together
    assert msgs[4] == {"role": "tool", "tool_call_id": "c1", "content": "one"}
    assert chat["max_tokens"] == 9 and chat["reasoning_effort"] == "low"
    assert chat["tools"][0]["function"] == {"name": "f", "parameters": {}, "strict": True}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"] == {"name": "s", "schema": {}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"stream_options": {"include_everything": True}}, "stream_options.include_everything"),
        ({"text": {"format": {"type": "text"}, "colour": "red"}}, "text.colour"),
        # Each item's place is named only when it is needed (an error): the same names.
        ({"input": [{"role": "user", "content": "x"}, "not an item"]}, "input[1]"),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
            "input[0].content[0].text",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "a"},
                            {"type": "input_text", "text": ["b"]},
                        ],
                    }
                ]
            },
            "input[0].content[1].text",
        ),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        (
            {
                "input": [
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "x"}]}
                ]
            },
            "input[0].output.content[0].type",
        ),
    ],
)
def test_what_chat_cannot_express_is_refused_by_name(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as e:
        to_chat({"model": "m", "input": "hi", **extra})
    assert e.value.status == 400 and e.value.param == param


def test_an_unknown_field_is_named_before_one_chat_cannot_carry_and_those_copied_arrive() -> None:
    """The translation reads the client's fields in one pass: an unknown one is refused
    whatever comes before it; of the fields set that chat cannot carry, the first is named;
    the fields chat has under the same name arrive, null ones left out."""
    for obj in (
        {"previous_response_id": "r", "background": True, "bogus": 1},
        {"bogus": 1, "previous_response_id": "r"},
    ):
        with pytest.raises(GatewayError) as e:
            to_chat({"model": "m", "input": "hi", **obj})
        assert e.value.code == "unknown_parameter" and e.value.param == "bogus"
    with pytest.raises(GatewayError) as e:
        to_chat({"model": "m", "input": "hi", "include": [], "background": True, "prompt": {}})
    assert e.value.code == "unsupported_parameter" and e.value.param == "background"
    chat = to_chat(
        {"top_p": 0.5, "model": "m", "input": "hi", "user": None, "include": [], "stream": True}
    )
    assert chat == {
        "top_p": 0.5,
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }


def test_embeddings_cost_their_input_only_and_responses_their_input_and_output() -> None:
    emb = cost.of_request({"model": "m", "input": ["a b c", "d"]}, 256, output=False)
    assert (emb.tokens, emb.output_param) == (4, "input")
    ids = cost.of_request({"model": "m", "input": [[1, 2, 3], [4]]}, 256, output=False)
    assert ids.tokens == 4
    resp = cost.of_request({"model": "m", "input": "one two", "max_output_tokens": 10}, 256)
    assert (resp.tokens, resp.output_param) == (12, "max_output_tokens")
    items = cost.of_request({"model": "m", "input": [{"role": "user", "content": "a b"}]}, 256)
    assert items.tokens == 2 + cost.PER_MESSAGE + 256 and items.output_param == "input"


def test_hostile_usage_values_count_as_nothing() -> None:
    d = ResponsesViaChat(REQUEST)
    usage = {"prompt_tokens": "7", "completion_tokens": -1, "prompt_tokens_details": [1]}
    chunks = [
        _chunk({"content": "x"}),
        _chunk({}, "stop"),
        orjson.dumps({"choices": [], "usage": usage}),
        b"[DONE]",
    ]
    events = parse(_bytes(_read(d, chunks)))
    check_events(events)
    assert events[-1]["response"]["usage"]["input_tokens"] == 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)
_FIELDS = st.sampled_from(
    ["input", "tools", "tool_choice", "text", "reasoning", "stream_options", "truncation",
     "store", "include", "metadata", "parallel_tool_calls", "instructions", "user"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(fields=st.dictionaries(_FIELDS, _json, max_size=4))
def test_any_json_in_any_field_is_translated_or_a_400(fields: dict[str, Any]) -> None:
    """Never a crash (a 500): whatever a client puts in a field, the translation carries it,
    or refuses it by name; and the Response it would answer with is still valid."""
    obj = {"model": "m", "input": "hi", **fields}
    try:
        parse_request(orjson.dumps(obj), ResponsesRequest)  # what the front checks first
        to_chat(obj)
    except GatewayError as e:
        assert e.status == 400 and e.param
        return
    d = ResponsesViaChat(obj)
    body = {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}
    orjson.loads(d.answer(b"", body))


_delta = st.fixed_dictionaries(
    {},
    optional={
        "content": _json,
        "reasoning_content": _json,
        "tool_calls": st.lists(
            st.fixed_dictionaries({}, optional={"index": _json, "id": _json, "function": _json}),
            max_size=2,
        )
        | _json,
    },
)
_chat_chunk = st.fixed_dictionaries(
    {},
    optional={
        "choices": st.lists(
            st.fixed_dictionaries({}, optional={"delta": _delta | _json, "finish_reason": _json}),
            max_size=2,
        )
        | _json,
        "usage": _json,
        "error": _json,
        "model": _json,
    },
)


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(_chat_chunk, max_size=6))
def test_any_chat_stream_translates_without_a_crash(chunks: list[dict[str, Any]]) -> None:
    """A hostile upstream's chunks: pieces (or one protocol error), never another exception;
    what the client gets still parses as Responses events."""
    d = ResponsesViaChat(REQUEST)
    reader = d.for_stream()
    out = []
    for c in [*chunks, "[DONE]"]:
        data = b"[DONE]" if c == "[DONE]" else orjson.dumps(c)
        piece = reader.read(data, None, None, False)
        if piece is not None and not piece.hidden:
            out.append(piece.event())
        if piece is not None and piece.end:
            break
    for event in parse(b"".join(out)):
        assert isinstance(event["sequence_number"], int)


def test_an_output_items_text_is_its_deltas_in_order_however_many() -> None:
    """A translated Response's item keeps its deltas as one JSON string (responses_output.py):
    read mid-stream, at its end, twice, or set whole, the text is the deltas in order, and its
    events carry it whole, escapes and all; its size counts the bytes it holds."""
    item = OutputItem("message", 0, "msg_1")
    deltas = [f'{i},"\\\n\x01é😀' if i % 7 == 0 else f"{i}," for i in range(5000)]
    for d in deltas[:2500]:
        item.extend(d)
    assert item.text == "".join(deltas[:2500])  # read mid-stream
    for d in deltas[2500:]:
        item.extend(d)
    whole = "".join(deltas)
    assert item.text == item.text == whole
    assert orjson.loads(orjson.dumps(item.part()))["text"] == whole
    assert item.size() == len(orjson.dumps(whole)) + ITEM_BYTES
    item.text = "whole"
    item.extend("!")
    got = orjson.loads(orjson.dumps(item.item("completed")))
    assert item.text == "whole!" and got["content"][0]["text"] == "whole!"


def test_native_events_pass_on_as_read_and_an_empty_name_is_left_out() -> None:
    """A native stream's named events go to the client as they were read (the read itself,
    not written again); an event whose `event:` line is empty goes without it, as a `data:`
    event (an SDK dispatches on the name)."""
    objs = [
        {"type": "response.created", "sequence_number": 0, "response": {"id": "r1"}},
        {"type": TEXT_DELTA, "output_index": 0, "content_index": 0, "delta": "Hi",
         "sequence_number": 1, "logprobs": []},
        {"type": "response.completed", "sequence_number": 2,
         "response": {"usage": {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6}}},
    ]  # fmt: skip
    datas = [orjson.dumps(o) for o in objs]

    def relayed(reads: list[bytes]) -> list[Piece]:
        parser = EventParser(StreamTally("u", "m", 0.0), False, ResponsesDialect().for_stream())
        return [p for r in reads for p in parser.feed(r)]

    named = [
        b"event: " + str(o["type"]).encode() + b"\ndata: " + d + b"\n\n"
        for o, d in zip(objs, datas, strict=True)
    ]
    for reads in (named, [b"".join(named)]):
        pieces = relayed(reads)
        assert b"".join(p.event() for p in pieces) == b"".join(named)
        assert pieces[-1].end and pieces[-1].usage == {
            "prompt_tokens": 5,
            "completion_tokens": 1,
            "total_tokens": 6,
        }
    assert relayed(named)[-1].raw is named[-1]
    unnamed = [b"event: \ndata: " + d + b"\n\n" for d in datas]
    for reads in (unnamed, [b"".join(unnamed)]):
        assert b"".join(p.event() for p in relayed(reads)) == b"".join(
            b"data: " + d + b"\n\n" for d in datas
        )


def test_a_translated_text_delta_is_the_bytes_its_events_dict_serialises_to() -> None:
    """`_Translation._text` writes a text delta's event from bytes it keeps (the head, the
    text as JSON): the same bytes as the event's dict through `encode_event`, escapes,
    non-ASCII and numbers past one digit included; and a merged run is still one event
    carrying every text in order."""
    d = ResponsesViaChat(REQUEST)
    texts = ["Hel", 'lo "q"', "\\\n\t\x01", "é😀", *(f" {i}" for i in range(12))]
    pieces = _read(d, [_chunk({"content": t}) for t in texts])
    deltas = []
    for piece in pieces:
        assert piece is not None and piece.raw is not None
        last = piece.raw[piece.raw.rfind(b"event: ") :]
        obj = orjson.loads(last[last.find(b"data: ") + 6 :])
        assert obj["type"] == TEXT_DELTA
        assert list(obj) == [
            "type", "item_id", "output_index", "content_index", "delta", "logprobs",
            "sequence_number",
        ]  # fmt: skip
        assert last == encode_event(obj)
        deltas.append(obj["delta"])
    assert deltas == texts
    head = pieces[1]
    assert head is not None and not pieces[0].mergeable()  # type: ignore[union-attr]
    for p in pieces[2:]:
        assert p is not None and head.join(p)
    merged = orjson.loads(head.event().split(b"data: ", 1)[1])
    assert merged["delta"] == "".join(texts[1:]) and merged["sequence_number"] == 5
    # After reasoning, the message is the second item: its head says so.
    d = ResponsesViaChat(REQUEST)
    pieces = _read(
        d, [_chunk({"reasoning_content": "hm"}), *(_chunk({"content": t}) for t in "ab")]
    )
    for piece, text in zip(pieces[1:], "ab", strict=True):
        assert piece is not None and piece.raw is not None
        last = piece.raw[piece.raw.rfind(b"event: ") :]
        obj = orjson.loads(last[last.find(b"data: ") + 6 :])
        assert last == encode_event(obj) and (obj["output_index"], obj["delta"]) == (1, text)


def test_chunks_of_other_shapes_while_the_message_is_open_take_the_general_path() -> None:
    """The usual token has a path of its own (one text delta while the message is open);
    a chunk of any other shape then is read as before: not crashed on, its finish, usage
    and other deltas kept, and the stream still valid."""
    d = ResponsesViaChat(REQUEST)
    reader = d.for_stream()

    def read(obj: dict[str, Any]) -> Piece | None:
        piece: Piece | None = reader.read(
            orjson.dumps({"id": "c1", "model": "m", **obj}), None, None, True
        )
        return piece

    pieces = [read({"choices": [{"delta": {"content": "a"}}]})]  # opens the message
    for odd in (["x"], [{"delta": "x"}], [{"delta": {"content": 5}}], [1, 2], "x"):
        assert read({"choices": odd}) is None
    counted = read({"choices": [{"delta": {"content": "b"}}], "usage": {"prompt_tokens": 1}})
    assert counted is not None and counted.usage == {"prompt_tokens": 1}
    thought = read({"choices": [{"delta": {"content": "c", "reasoning_content": "r"}}]})
    assert thought is not None and not thought.mergeable()
    done = read({"choices": [{"delta": {"content": "d"}, "finish_reason": "length"}]})
    assert done is not None and done.finish_reason == "length"
    pieces += [counted, thought, done, reader.read(b"[DONE]", None, None, True)]
    events = parse(_bytes(pieces))
    check_events(events)
    assert text_of(events) == "abcd"
    assert check_response(events[-1]["response"]).status == "incomplete"
