"""Hostile upstream values of an unexpected type on the translated paths, end to end: a
Messages client on an OpenAI upstream and a chat client on an Anthropic one, the gateway a
process in front of a scripted upstream (tests/hostile_upstream.py). A translation reads
fields a native relay passes on unread (`tool_calls[].index`, `usage`, `delta`); a value of
the wrong type there (`[0]`, `"x"`, `5`) was a TypeError or AttributeError: a 500, a stream
ended by "internal error", and, before the first token, a retry (the upstream asked twice)
counted against its breaker. Now it is the upstream's protocol error, never retried."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests import procs
from tests.hostile_upstream import DONE, HostileUpstream, Reply, chat_chunk, json_reply, sse_reply
from tests.test_hostile_stream import _no_crash
from tokenpipe.context.tokens import message_text
from tokenpipe.settings import UpstreamSettings
from tokenpipe.upstream.http import HttpUpstream


def _chunk(delta: Any) -> bytes:
    obj = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    obj["choices"] = [{"index": 0, "delta": delta, "finish_reason": None}]
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **obj}) + b"\n\n"


_START = _event("message_start", {"message": {"id": "m", "usage": {"input_tokens": 1}}})
_TEXT = _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
_A = _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "a"}})

#: Scenario (the request's text) -> the upstream's answer.
SCRIPTS: dict[str, Reply] = {
    # OpenAI upstream, read by the Messages translation.
    "index_list_first": sse_reply([_chunk({"tool_calls": [{"index": [0], "id": "t"}]}), DONE]),
    "index_dict_mid": sse_reply(
        [chat_chunk("a"), _chunk({"tool_calls": [{"index": {"a": 1}, "id": "t"}]}), DONE]
    ),
    "tool_calls_int_mid": sse_reply([chat_chunk("a"), _chunk({"tool_calls": 5}), DONE]),
    "unary_choices_int": json_reply(b'{"id": "x", "choices": 5}'),
    "unary_message_str": json_reply(b'{"id": "x", "choices": [{"message": "hi"}]}'),
    "unary_finish_list": json_reply(
        b'{"id": "x", "choices": [{"message": {"content": "hi"}, "finish_reason": ["stop"]}]}'
    ),
    # Anthropic upstream, read by the chat translation.
    "message_str_first": sse_reply([_event("message_start", {"message": "x"})]),
    "usage_list_first": sse_reply([_event("message_start", {"message": {"usage": [1]}})]),
    "delta_str_mid": sse_reply([_START, _TEXT, _A, _event("content_block_delta", {"delta": "x"})]),
    "unary_content_int": json_reply(b'{"id": "m", "type": "message", "content": 5}'),
    "unary_content_int_large": json_reply(
        b'{"id": "m", "type": "message", "content": 5, "x": "' + b"a" * 70_000 + b'"}'
    ),
}


#: Requests the upstream got, by scenario.
SENT: Counter[str] = Counter()


def _route(req: dict[str, Any]) -> Reply:
    if "messages" not in req:  # not a scenario's (the gateway's own asks)
        return json_reply(b'{"error": {"message": "no"}}', b"404 Not Found")
    content = req["messages"][-1]["content"]  # text, or Anthropic's text blocks
    text = content if isinstance(content, str) else content[0]["text"]
    SENT[text] += 1
    return SCRIPTS[text]


@pytest.fixture(scope="module")
def upstream() -> Iterator[HostileUpstream]:
    with HostileUpstream(_route) as up:
        yield up


@pytest.fixture(scope="module")
def via_chat(upstream: HostileUpstream) -> Iterator[procs.Service]:
    """Messages clients, an OpenAI upstream."""
    with procs.gateway("--upstream", upstream.url + "/v1") as g:
        yield g


@pytest.fixture(scope="module")
def via_messages(upstream: HostileUpstream) -> Iterator[procs.Service]:
    """Chat clients, an Anthropic upstream."""
    with procs.gateway("--upstream", "anthropic+" + upstream.url + "/v1") as g:
        yield g


async def _post(gw: procs.Service, path: str, text: str, stream: bool) -> tuple[int, bytes]:
    body = {
        "model": "sim-model",
        "max_tokens": 8,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    }
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.post(gw.url + path, json=body) as r:
        return r.status, await r.read()


@pytest.mark.parametrize(
    ("text", "before"),
    [("index_list_first", ""), ("index_dict_mid", "a"), ("tool_calls_int_mid", "a")],
)
async def test_a_messages_stream_ends_with_the_protocol_error_and_is_sent_once(
    via_chat: procs.Service, text: str, before: str
) -> None:
    status, body = await _post(via_chat, "/v1/messages", text, stream=True)
    assert status == 200
    events = [ln for ln in body.decode().splitlines() if ln.startswith("event: ")]
    assert events[-1] == "event: error", body  # the last event: no message_stop after it
    assert b"upstream_protocol_error" in body or b"unexpected shape" in body, body
    assert b'"text":"a"' in body if before else b"text_delta" not in body, body
    assert b"internal" not in body.lower(), body
    assert SENT[text] == 1  # not retried: asking again gets the same
    _no_crash(via_chat)


@pytest.mark.parametrize("text", ["unary_choices_int", "unary_message_str"])
async def test_a_messages_answer_of_the_wrong_shape_is_a_502(
    via_chat: procs.Service, text: str
) -> None:
    status, body = await _post(via_chat, "/v1/messages", text, stream=False)
    assert status == 502, body
    assert b"unexpected shape" in body and b"internal" not in body.lower(), body
    _no_crash(via_chat)


async def test_a_responses_answer_via_chat_of_the_wrong_shape_is_a_502(
    via_chat: procs.Service,
) -> None:
    body = {"model": "sim-model", "input": "unary_finish_list", "max_output_tokens": 8}
    timeout = aiohttp.ClientTimeout(total=20)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(via_chat.url + "/v1/responses", json=body) as r,
    ):
        got = await r.read()
    assert r.status == 502, got
    assert orjson.loads(got)["error"]["code"] == "upstream_protocol_error", got
    _no_crash(via_chat)


@pytest.mark.parametrize(
    ("text", "before", "code"),
    [
        ("message_str_first", "", "upstream_protocol_error"),
        # A usage that is not an object is not read, as on the native path (event_json.py
        # builds only objects); the script's stream then ends without `message_stop`.
        ("usage_list_first", "", "upstream_stream_truncated"),
        ("delta_str_mid", "a", "upstream_protocol_error"),
    ],
)
async def test_a_chat_stream_on_anthropic_ends_with_the_protocol_error_and_is_sent_once(
    via_messages: procs.Service, text: str, before: str, code: str
) -> None:
    status, body = await _post(via_messages, "/v1/chat/completions", text, stream=True)
    assert status == 200
    data = [ln[6:] for ln in body.decode().splitlines() if ln.startswith("data: ")]
    last = orjson.loads(data[-1])  # no [DONE] after the error
    assert last["error"]["code"] == code, body
    contents = [
        (c.get("delta") or {}).get("content")
        for ev in map(orjson.loads, data[:-1])
        for c in ev.get("choices") or ()
    ]
    assert "".join(x for x in contents if x) == before, body
    assert SENT[text] == 1
    _no_crash(via_messages)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("unary_content_int", b"unexpected shape"),  # read whole, judged by the translation
        # Past 64 KiB an answer is read only in its API's shape (dialects/event_json.py).
        ("unary_content_int_large", b"with a field of an unexpected type"),
    ],
)
async def test_a_chat_answer_on_anthropic_of_the_wrong_shape_is_a_502(
    via_messages: procs.Service, text: str, says: bytes
) -> None:
    status, body = await _post(via_messages, "/v1/chat/completions", text, False)
    assert status == 502, body
    assert orjson.loads(body)["error"]["code"] == "upstream_protocol_error"
    assert says in body and b"internal" not in body.lower(), body
    _no_crash(via_messages)


async def test_model_ids_that_are_not_strings_are_skipped_not_a_500() -> None:
    """One id of another type in an upstream's /models made every model list a 500 (sorted
    in a set with the others); the ids that are strings still count."""
    u = HttpUpstream(UpstreamSettings(name="u", url="http://127.0.0.1:9/v1"))
    listed = [{"id": 1}, {"id": "b"}, {"id": ["a"]}, "c", {"id": {"x": 1}}, {"id": "a"}]
    listed.append({"id": "x" * 257})  # longer than a client may name: not a metric label
    assert u._learn({"data": listed}, 0.0) == {"b", "a"}
    assert u._learn({"data": [{"id": 1}]}, 0.0) is None  # no model list at all
    assert u._learn({"data": {"id": "a"}}, 0.0) is None
    await u.close()


def test_tool_calls_of_another_type_count_nothing_in_the_context_budget() -> None:
    """The schema leaves `tool_calls` untyped (the upstream judges it); the budget's count
    of a message's text read it as a list: `5` was a 500 for a model with a known window."""
    for calls in (5, True, "x", {"a": 1}):
        message = {"role": "assistant", "content": "x", "tool_calls": calls}
        assert message_text(message) == "x"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
async def test_a_request_nested_deeper_than_json_is_written_is_a_400(
    via_chat: procs.Service, path: str
) -> None:
    """orjson reads 1,024 levels of nesting and writes 255: a streamed request the gateway
    writes again (asking for usage, or translated) nested 300 deep was a 500."""
    deep: Any = []
    for _ in range(300):
        deep = [deep]
    body: dict[str, Any] = {"model": "sim-model", "stream": True, "max_tokens": 8}
    if path == "/v1/chat/completions":  # in a content part (asking for usage rewrites it)
        body["messages"] = [
            {"role": "user", "content": [{"type": "text", "text": "hi", "x": deep}]}
        ]
    elif path == "/v1/messages":  # in a tool call's input (written as chat's arguments)
        call = {"type": "tool_use", "id": "t", "name": "f", "input": {"a": deep}}
        result = {"type": "tool_result", "tool_use_id": "t", "content": "ok"}
        body["messages"] = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]
    else:  # in a tool's parameters (kept as they are in the chat request written)
        del body["max_tokens"]
        body["input"] = "hi"
        body["tools"] = [{"type": "function", "name": "f", "parameters": {"a": deep}}]
    timeout = aiohttp.ClientTimeout(total=20)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(via_chat.url + path, json=body) as r,
    ):
        assert r.status == 400, await r.read()
        assert b"Recursion" in await r.read()
    _no_crash(via_chat)
