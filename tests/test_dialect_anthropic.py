"""The Anthropic Messages dialect on its own: its events fed as bytes through the relay's
parser, as an upstream's reads would arrive (any split), merged as a slow client gets them,
and validated against the official SDK's own event types."""

from __future__ import annotations

import random
import time
from typing import Any

import anthropic
import orjson
import pytest
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from tokenpipe import sse
from tokenpipe.dialects import MESSAGES, Piece
from tokenpipe.dialects.anthropic import COUNT_TOKENS, openai_usage
from tokenpipe.errors import GatewayError
from tokenpipe.relay.buffer import Accumulator
from tokenpipe.relay.events import EventParser
from tokenpipe.relay.tally import StreamTally

EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)


def _ev(name: str, **fields: Any) -> bytes:
    data = orjson.dumps({"type": name, **fields})
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


def _text(index: int, text: str) -> bytes:
    return _ev("content_block_delta", index=index, delta={"type": "text_delta", "text": text})


def _json(index: int, part: str) -> bytes:
    return _ev(
        "content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": part}
    )


START_USAGE = {
    "input_tokens": 12,
    "output_tokens": 1,
    "cache_creation_input_tokens": 3,
    "cache_read_input_tokens": 5,
}
MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "claude-x",
    "content": [],
    "stop_reason": None,
    "stop_sequence": None,
    "usage": START_USAGE,
}
WORDS = [f" w{i}" for i in range(10)]
TOOL_PARTS = ['{"q": "', "a", " b", '"}']
STREAM = [
    _ev("message_start", message=MESSAGE),
    _ev("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    _ev("ping"),
    *(_text(0, w) for w in WORDS),
    _ev("content_block_stop", index=0),
    _ev(
        "content_block_start",
        index=1,
        content_block={"type": "tool_use", "id": "toolu_1", "name": "get", "input": {}},
    ),
    _json(1, ""),  # Anthropic opens a tool's input with an empty part: no token
    *(_json(1, p) for p in TOOL_PARTS),
    _ev("content_block_stop", index=1),
    _ev(
        "message_delta",
        delta={"stop_reason": "tool_use", "stop_sequence": None},
        usage={"output_tokens": 14},
    ),
    _ev("message_stop"),
]
#: message_start's input (and cache) counts joined with message_delta's output count.
USAGE = {
    "prompt_tokens": 20,
    "cache_creation_input_tokens": 3,
    "cache_read_input_tokens": 5,
    "completion_tokens": 14,
    "total_tokens": 34,
}


def _parse(reads: list[bytes]) -> tuple[list[Piece], StreamTally]:
    tally = StreamTally("u", "m", time.perf_counter())
    parser = EventParser(tally, False, MESSAGES.for_stream())
    pieces: list[Piece] = []
    for r in reads:
        pieces += parser.feed(r)
    return pieces, tally


def _queued(pieces: list[Piece]) -> list[Piece]:
    """The pieces as a client that fell behind gets them: queued, merged, taken at once."""
    acc = Accumulator()
    for p in pieces:
        acc.put(p)
    out, _ = acc.take(1 << 30)
    return out


def _data(event: bytes) -> dict[str, Any]:
    name, data = event.split(b"\n", 1)
    obj = orjson.loads(data.removeprefix(b"data: "))
    assert name == b"event: " + obj["type"].encode()  # the SDKs dispatch on the event line
    return obj  # type: ignore[no-any-return]


def test_any_split_of_the_reads_gives_the_same_events_usage_and_finish() -> None:
    whole, tally = _parse(STREAM)
    assert [p.event() for p in whole] == STREAM  # passed on byte for byte
    assert all(p.raw is read for p, read in zip(whole, STREAM, strict=True))  # not written again
    assert tally.usage == USAGE and tally.done and tally.finished
    body = b"".join(STREAM)
    rng = random.Random(19)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(body)), 15))
        reads = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        split, t2 = _parse(reads)
        assert [p.event() for p in split] == STREAM
        assert [p.count for p in split] == [p.count for p in whole]
        assert t2.usage == USAGE and t2.done and t2.finished
    # Text deltas and the tool's input parts are content (a token each); the empty opening
    # part, block starts and stops, ping and the message events are not.
    assert sum(p.count for p in whole) == len(WORDS) + len(TOOL_PARTS)
    assert [p.finish_reason for p in whole if p.finish_reason] == ["tool_use"]
    assert whole[-1].end and not any(p.end for p in whole[:-1])


def test_events_validate_against_the_sdks_types_and_data_only_events_get_their_name() -> None:
    for raw in STREAM:
        if b"event: ping" not in raw:  # ping is not in the SDK's union (it skips pings)
            EVENT.validate_python(_data(raw))
    # An upstream that writes `data:` alone: the event line is added (the SDK drops events
    # without one); the data is passed on as it came.
    data_only = [raw.split(b"\n", 1)[1] for raw in STREAM]
    pieces, tally = _parse(data_only)
    assert [p.event() for p in pieces] == STREAM and tally.usage == USAGE
    # So is an empty one, in reads of one event and of all of them.
    unnamed = [b"event: \n" + data for data in data_only]
    for reads in (unnamed, [b"".join(unnamed)]):
        pieces, tally = _parse(reads)
        assert [p.event() for p in pieces] == STREAM and tally.usage == USAGE


def test_queued_text_deltas_merge_within_their_block_and_tool_input_never_merges() -> None:
    # Block 2, and blocks 20 and 21 (past the kinds made once), merge each within itself.
    second_text = [_text(2, " x"), _text(2, " y"), _text(20, " v"), _text(20, " w")]
    second_text += [_text(21, " u")]
    pieces, _ = _parse([*STREAM[:-2], *second_text, *STREAM[-2:]])
    out = _queued(pieces)
    merged = [p for p in out if p.count > 1]
    assert [p.count for p in merged] == [len(WORDS), 2, 2]  # block 0's ten, 2's two, 20's two
    first = _data(merged[0].event())
    assert first["index"] == 0 and first["delta"] == {"type": "text_delta", "text": "".join(WORDS)}
    assert _data(merged[1].event())["index"] == 2  # blocks never merge into each other
    EVENT.validate_python(first)
    tool = [p for p in out if p.count and b"input_json_delta" in p.event()]
    assert [p.text for p in tool] == TOOL_PARTS  # one event per part, as sent
    assert "".join(p.text for p in out) == "".join(WORDS) + "".join(TOOL_PARTS) + " x y v w u"


def test_thinking_deltas_are_content_but_never_merged() -> None:
    thinking = [
        _ev("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": t})
        for t in ("Let", " me", " think")
    ]
    signature = _ev(
        "content_block_delta", index=0, delta={"type": "signature_delta", "signature": "sig"}
    )
    pieces, _ = _parse([*thinking, signature])
    assert [p.count for p in pieces] == [1, 1, 1, 0]
    assert pieces[0].first and not pieces[3].first
    assert [p.count for p in _queued(pieces)] == [1, 1, 1, 0]


def test_a_split_merged_piece_keeps_its_block_and_text() -> None:
    pieces, _ = _parse([_text(3, w) for w in WORDS])
    acc = Accumulator()
    for p in pieces:
        acc.put(p)
    head, n = acc.take(4)
    rest, m = acc.take(1 << 30)
    assert (n, m) == (4, 6)
    texts = [_data(p.event())["delta"]["text"] for p in head + rest]
    assert "".join(texts) == "".join(WORDS)
    assert {_data(p.event())["index"] for p in head + rest} == {3}


def test_an_error_event_ends_the_stream_and_nothing_after_it_is_passed_on() -> None:
    error = _ev("error", error={"type": "overloaded_error", "message": "Overloaded"})
    pieces, tally = _parse([STREAM[0] + _text(0, " a") + error + _text(0, " late")])
    assert [p.count for p in pieces] == [0, 1, 0]
    assert pieces[-1].error == {"type": "overloaded_error", "message": "Overloaded"}
    assert pieces[-1].end and tally.finished and not tally.done


@pytest.mark.parametrize("bad", [b"event: ping\ndata: {not json\n\n", b"data: [1,2]\n\n"])
def test_broken_events_are_protocol_errors(bad: bytes) -> None:
    tally = StreamTally("u", "m", time.perf_counter())
    parser = EventParser(tally, False, MESSAGES.for_stream())
    pieces = parser.feed(_text(0, "x") + bad + _text(0, "y"))
    assert [p.text for p in pieces] == ["x"]
    with pytest.raises(sse.SSEProtocolError):
        parser.at_end()


def test_shapes_the_typed_decode_refuses_are_passed_on_and_not_acted_on() -> None:
    odd = [
        _ev("content_block_delta", index="0", delta={"type": "text_delta", "text": "a"}),
        _ev("content_block_delta", index=0, delta={"type": "text_delta", "text": 5}),
        _ev("message_delta", delta="x", usage={"output_tokens": "9"}),
    ]
    pieces, tally = _parse(odd)
    assert [p.event() for p in pieces] == odd
    assert [p.count for p in pieces] == [1, 0, 0]  # text read; a number is no text
    assert not pieces[0].may_merge  # no block index: nothing to merge within
    assert tally.usage is None  # "9" is not a count


def test_the_shared_dialect_is_stateless_and_each_stream_joins_its_own_usage() -> None:
    delta = _ev("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 7})
    piece = MESSAGES.read(delta.split(b"data: ", 1)[1][:-2], "message_delta", None, False)
    assert piece is not None and piece.usage == {"completion_tokens": 7}
    a, b = MESSAGES.for_stream(), MESSAGES.for_stream()
    assert a is not b and a is not MESSAGES
    # Counts later in the stream win (message_delta's are cumulative, input included on some
    # servers).
    later = _ev("message_delta", delta={}, usage={"input_tokens": 13, "output_tokens": 9})
    _, tally = _parse([STREAM[0], delta, later])
    assert tally.usage == {
        "prompt_tokens": 21,
        "cache_creation_input_tokens": 3,
        "cache_read_input_tokens": 5,
        "completion_tokens": 9,
        "total_tokens": 30,
    }


def test_usage_of_a_message_and_of_a_token_count() -> None:
    body = {**MESSAGE, "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn"}
    assert MESSAGES.usage_of(body) == {**USAGE, "completion_tokens": 1, "total_tokens": 21}
    assert MESSAGES.usage_of({"usage": "nonsense"}) is None
    assert openai_usage({"input_tokens": -1, "output_tokens": True}) is None
    # Counting tokens costs none: the reservation comes back.
    assert COUNT_TOKENS.usage_of({"input_tokens": 99}) == {
        "prompt_tokens": 0,
        "completion_tokens": 0,
    }


def test_errors_in_anthropics_shape() -> None:
    event = MESSAGES.error_event(GatewayError(502, "cut"))
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert _data(event) == {"type": "error", "error": {"type": "api_error", "message": "cut"}}
    for status, kind in [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (529, "overloaded_error"),
    ]:
        body = orjson.loads(MESSAGES.error_body(GatewayError(status, "m")))
        assert body == {"type": "error", "error": {"type": kind, "message": "m"}}
        if kind != "request_too_large":  # documented, but not in the SDK's union
            ErrorResponse.model_validate(body)
