"""Upstream events and answers whose JSON has any value at the fields each dialect reads,
in-process (thousands of cases in seconds): a dialect's reading either yields pieces or
fails as the upstream's protocol error, never with another exception (a 500 or a stream cut
by "internal error"). The translations read fields a native relay passes on unread; a value
of a type they did not expect there (`tool_calls[].index: [0]`, `usage: "x"`) was a 500
until these cases (docs/reliability.md)."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz_bodies import json_values
from tokenpipe import sse
from tokenpipe.dialects import Dialect
from tokenpipe.dialects.anthropic import MessagesDialect
from tokenpipe.dialects.chat_via_messages import ChatViaMessages
from tokenpipe.dialects.messages_via_chat import MessagesViaChat
from tokenpipe.dialects.openai import ChatDialect
from tokenpipe.dialects.responses import ResponsesDialect
from tokenpipe.dialects.responses_chat import ResponsesViaChat
from tokenpipe.relay.events import EventParser
from tokenpipe.relay.tally import StreamTally

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None
)

_TOOL = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}


def _chunk(delta: Any, finish: Any = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}


#: A chat stream with text, a tool call, a finish and usage.
CHAT_STREAM: list[dict[str, Any]] = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"content": "a"}),
    _chunk({"content": "b"}),  # a text block that goes on (a translation's usual token)
    _chunk({"tool_calls": [_TOOL]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
    _chunk({}, "tool_calls"),
    {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
]
CHAT_PATHS = [
    ("choices",),
    ("choices", 0),
    ("choices", 0, "index"),
    ("choices", 0, "delta"),
    ("choices", 0, "delta", "role"),
    ("choices", 0, "delta", "content"),
    ("choices", 0, "delta", "reasoning_content"),
    ("choices", 0, "delta", "tool_calls"),
    ("choices", 0, "delta", "tool_calls", 0),
    ("choices", 0, "delta", "tool_calls", 0, "index"),
    ("choices", 0, "delta", "tool_calls", 0, "id"),
    ("choices", 0, "delta", "tool_calls", 0, "function"),
    ("choices", 0, "delta", "tool_calls", 0, "function", "name"),
    ("choices", 0, "delta", "tool_calls", 0, "function", "arguments"),
    ("choices", 0, "finish_reason"),
    ("choices", 0, "logprobs"),
    ("usage",),
    ("usage", "prompt_tokens"),
    ("usage", "completion_tokens"),
    ("usage", "prompt_tokens_details"),
    ("error",),
    ("model",),
    ("id",),
]


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


#: A Messages stream with text, a tool use, a stop reason and usage.
MESSAGES_STREAM: list[dict[str, Any]] = [
    _event("message_start", message={"id": "m", "model": "c", "usage": {"input_tokens": 3}}),
    _event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    _event("content_block_delta", index=0, delta={"type": "text_delta", "text": "a"}),
    _event("content_block_stop", index=0),
    _event(
        "content_block_start",
        index=1,
        content_block={"type": "tool_use", "id": "t", "name": "f", "input": {}},
    ),
    _event(
        "content_block_delta", index=1, delta={"type": "input_json_delta", "partial_json": "{}"}
    ),
    _event("content_block_stop", index=1),
    _event("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 2}),
    _event("message_stop"),
]
MESSAGES_PATHS = [
    ("type",),
    ("message",),
    ("message", "id"),
    ("message", "usage"),
    ("message", "usage", "input_tokens"),
    ("message", "usage", "cache_read_input_tokens"),
    ("index",),
    ("content_block",),
    ("content_block", "type"),
    ("content_block", "id"),
    ("content_block", "name"),
    ("content_block", "text"),
    ("delta",),
    ("delta", "type"),
    ("delta", "text"),
    ("delta", "partial_json"),
    ("delta", "thinking"),
    ("delta", "stop_reason"),
    ("usage",),
    ("usage", "output_tokens"),
    ("error",),
]


def _has(obj: Any, step: str | int, new: bool = False) -> bool:
    """`obj[step]` is there (or, `new`, may be set in a dict)."""
    if isinstance(obj, dict):
        return isinstance(step, str) and (new or step in obj)
    return isinstance(obj, list) and isinstance(step, int) and step < len(obj)


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    """`value` at `path` in `obj`, where the containers on the way exist (else nothing)."""
    for step in path[:-1]:
        if not _has(obj, step):
            return
        obj = obj[step]
    if _has(obj, path[-1], new=True):
        obj[path[-1]] = value


def _mutations(stream: list[dict[str, Any]], paths: list[tuple[Any, ...]]) -> Any:
    one = st.tuples(st.integers(0, len(stream) - 1), st.sampled_from(paths), json_values)
    return st.lists(one, min_size=1, max_size=3)


def _mutated(stream: list[dict[str, Any]], changes: list[tuple[int, Any, Any]]) -> list[Any]:
    out = copy.deepcopy(stream)
    for i, path, value in changes:
        _set(out[i], path, value)
    return out


def _reads(events: list[Any], named: bool) -> list[bytes]:
    """Each event as one SSE read (`event:` lines too, as Anthropic sends them)."""
    out = []
    for ev in events:
        name = ev.get("type") if named and isinstance(ev, dict) else None
        head = b"event: " + name.encode() + b"\n" if isinstance(name, str) and name else b""
        # json, not orjson: an upstream's integers may pass 64 bits
        out.append(head + sse.encode(json.dumps(ev, separators=(",", ":")).encode()))
    return out


def _relayed(dialect: Dialect, reads: list[bytes]) -> None:
    """The reads through the relay's parser: pieces, or the protocol error, nothing else."""
    parser = EventParser(StreamTally("u", "m", time.perf_counter()), False, dialect)
    try:
        for r in reads:
            for piece in parser.feed(r):
                piece.event()  # what the client gets, written
        parser.at_end()
    except sse.SSEProtocolError:
        pass


_RESPONSE = {"id": "r", "object": "response", "status": "in_progress", "output": []}
_DONE_RESPONSE = {
    **_RESPONSE,
    "status": "completed",
    "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
}
_ITEM = {"type": "message", "id": "i", "role": "assistant", "content": []}
#: A Responses stream (the API's own events, numbered) with text and a completed response.
RESPONSES_STREAM: list[dict[str, Any]] = [
    _event("response.created", sequence_number=0, response=_RESPONSE),
    _event("response.output_item.added", sequence_number=1, output_index=0, item=_ITEM),
    _event(
        "response.output_text.delta",
        sequence_number=2,
        item_id="i",
        output_index=0,
        content_index=0,
        delta="a",
    ),
    _event("response.completed", sequence_number=3, response=_DONE_RESPONSE),
]
RESPONSES_PATHS = [
    ("type",),
    ("sequence_number",),
    ("response",),
    ("response", "status"),
    ("response", "output"),
    ("response", "usage"),
    ("response", "usage", "input_tokens"),
    ("response", "usage", "output_tokens"),
    ("response", "incomplete_details"),
    ("response", "error"),
    ("output_index",),
    ("content_index",),
    ("item",),
    ("item", "type"),
    ("item", "content"),
    ("delta",),
    ("logprobs",),
    ("error",),
    ("message",),
    ("code",),
]

READERS: dict[str, tuple[Callable[[], Dialect], list[Any], list[Any], bool]] = {
    "chat": (ChatDialect, CHAT_STREAM, CHAT_PATHS, False),
    "messages via chat": (
        lambda: MessagesViaChat({"model": "m", "max_tokens": 8}),
        CHAT_STREAM,
        CHAT_PATHS,
        False,
    ),
    "responses via chat": (
        lambda: ResponsesViaChat({"model": "m", "input": "hi"}),
        CHAT_STREAM,
        CHAT_PATHS,
        False,
    ),
    "messages": (MessagesDialect, MESSAGES_STREAM, MESSAGES_PATHS, True),
    "chat via messages": (
        lambda: ChatViaMessages({"model": "m", "stream_options": {"include_usage": True}}),
        MESSAGES_STREAM,
        MESSAGES_PATHS,
        True,
    ),
    "responses": (ResponsesDialect, RESPONSES_STREAM, RESPONSES_PATHS, True),
}


def _case(name: str) -> Any:
    make, stream, paths, named = READERS[name]

    @FUZZ
    @given(changes=_mutations(stream, paths))
    def case(changes: list[tuple[int, Any, Any]]) -> None:
        _relayed(make().for_stream(), _reads(_mutated(stream, changes), named))

    return case


@pytest.mark.parametrize("name", list(READERS))
def test_a_stream_of_any_shape_is_read_or_ends_as_the_protocol_error(name: str) -> None:
    """`name`: the API the events are in, and the client's when it is another."""
    _case(name)()


CHAT_ANSWER: dict[str, Any] = {
    "id": "c",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "a", "tool_calls": [_TOOL]},
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2},
}
ANSWER_PATHS = [
    ("choices",),
    ("choices", 0),
    ("choices", 0, "message"),
    ("choices", 0, "message", "content"),
    ("choices", 0, "message", "reasoning_content"),
    ("choices", 0, "message", "tool_calls"),
    ("choices", 0, "message", "tool_calls", 0),
    ("choices", 0, "message", "tool_calls", 0, "id"),
    ("choices", 0, "message", "tool_calls", 0, "function"),
    ("choices", 0, "message", "tool_calls", 0, "function", "name"),
    ("choices", 0, "message", "tool_calls", 0, "function", "arguments"),
    ("choices", 0, "finish_reason"),
    ("usage",),
    ("usage", "prompt_tokens"),
    ("usage", "prompt_tokens_details"),
    ("model",),
    ("id",),
]
MESSAGES_ANSWER: dict[str, Any] = {
    "id": "m",
    "type": "message",
    "role": "assistant",
    "model": "c",
    "content": [
        {"type": "text", "text": "a"},
        {"type": "tool_use", "id": "t", "name": "f", "input": {}},
    ],
    "stop_reason": "tool_use",
    "usage": {"input_tokens": 3, "output_tokens": 2},
}
MESSAGES_ANSWER_PATHS = [
    ("content",),
    ("content", 0),
    ("content", 0, "type"),
    ("content", 0, "text"),
    ("content", 1, "id"),
    ("content", 1, "name"),
    ("content", 1, "input"),
    ("stop_reason",),
    ("usage",),
    ("usage", "input_tokens"),
    ("usage", "cache_read_input_tokens"),
    ("model",),
    ("id",),
]
ANSWERS: dict[str, tuple[Callable[[], Dialect], dict[str, Any], list[Any]]] = {
    "messages via chat": (
        lambda: MessagesViaChat({"model": "m", "max_tokens": 8}),
        CHAT_ANSWER,
        ANSWER_PATHS,
    ),
    "responses via chat": (
        lambda: ResponsesViaChat({"model": "m", "input": "hi"}),
        CHAT_ANSWER,
        ANSWER_PATHS,
    ),
    "chat via messages": (
        lambda: ChatViaMessages({"model": "m"}),
        MESSAGES_ANSWER,
        MESSAGES_ANSWER_PATHS,
    ),
}


def _answered(name: str) -> Any:
    """A whole answer of any shape: its usage and the client's body are read, or the reading
    fails with one of sse.SHAPE_ERRORS, which the front answers as a 502 protocol error."""
    make, answer, paths = ANSWERS[name]

    @FUZZ
    @given(changes=_mutations([answer], paths))
    def case(changes: list[tuple[int, Any, Any]]) -> None:
        obj = _mutated([answer], changes)[0]
        dialect = make()
        try:
            dialect.usage_of(obj)
            dialect.answer(json.dumps(obj).encode(), obj)
        except sse.SHAPE_ERRORS:
            pass

    return case


@pytest.mark.parametrize("name", list(ANSWERS))
def test_an_answer_of_any_shape_is_read_or_fails_as_a_shape_error(name: str) -> None:
    _answered(name)()
