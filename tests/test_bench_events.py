"""The bench client's recorders of Responses and Messages streams (bench/events.py) on made-up
events (no network): what counts as the first token, where the token counts come from, and
when a stream is cut off or failed."""

from __future__ import annotations

import orjson
import pytest

from tokenpipe.bench import RequestRecord
from tokenpipe.bench.apis import api_url, auth_headers, messages_body, responses_body
from tokenpipe.bench.clients import ChatRequest
from tokenpipe.bench.events import MessagesRecorder, ResponsesRecorder


def _ev(kind: str, obj: dict[str, object], named: bool = True) -> bytes:
    data = b"data: " + orjson.dumps({"type": kind, **obj}) + b"\n\n"
    return (b"event: " + kind.encode() + b"\n" + data) if named else data


def _responses(named: bool) -> list[bytes]:
    snapshot = {"id": "resp_1", "status": "in_progress", "output": []}
    usage = {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}
    return [
        _ev("response.created", {"response": snapshot}, named),
        _ev("response.output_item.added", {"output_index": 0, "item": {}}, named),
        _ev("response.output_text.delta", {"delta": ""}, named),  # empty: no token
        _ev("response.output_text.delta", {"delta": "Hi"}, named),
        _ev("response.function_call_arguments.delta", {"delta": '{"a"'}, named),
        _ev("response.output_text.done", {"text": "Hi"}, named),
        _ev("response.completed", {"response": {"status": "completed", "usage": usage}}, named),
    ]


@pytest.mark.parametrize("named", [True, False], ids=["event-lines", "data-only"])
def test_responses_ttft_is_the_first_non_empty_delta_and_usage_is_the_terminal_events(
    named: bool,
) -> None:
    rec = RequestRecord(sent_at=0.0, status=200)
    r = ResponsesRecorder(rec)
    for t, event in enumerate(_responses(named)):
        r.feed(event, t / 100)
    r.close(0.1)
    assert rec.ok, rec.error
    assert rec.chunk_times == pytest.approx([0.03, 0.04])
    assert rec.ttft == pytest.approx(0.03)
    assert (rec.usage_completion_tokens, rec.usage_prompt_tokens) == (3, 7)
    assert rec.finish_reason == "completed"


def test_a_responses_stream_cut_before_its_end_or_failed_is_an_error() -> None:
    rec = RequestRecord(sent_at=0.0, status=200)
    r = ResponsesRecorder(rec)
    r.feed(b"".join(_responses(True)[:4]), 0.01)
    r.close(0.02)
    assert not rec.ok and "response.completed" in (rec.error or "")
    rec = RequestRecord(sent_at=0.0, status=200)
    r = ResponsesRecorder(rec)
    failed = {"response": {"status": "failed", "error": {"message": "boom"}}}
    r.feed(_ev("response.failed", failed), 0.01)
    r.close(0.02)
    assert rec.error == "stream error: boom"


def _messages(named: bool) -> list[bytes]:
    start = {"message": {"usage": {"input_tokens": 9, "output_tokens": 1}}}
    tool = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    return [
        _ev("message_start", start, named),
        _ev("content_block_start", {"index": 0, "content_block": {"type": "text"}}, named),
        _ev("ping", {}, named),
        _ev(
            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": ""}}, named
        ),
        _ev(
            "content_block_delta",
            {"index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
            named,
        ),
        _ev("content_block_start", {"index": 1, "content_block": tool}, named),
        _ev(
            "content_block_delta",
            {"index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"x": "'}},
            named,
        ),
        _ev("content_block_delta", {"index": 1, "delta": {"type": "signature_delta"}}, named),
        _ev(
            "message_delta",
            {"delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 4}},
            named,
        ),
        _ev("message_stop", {}, named),
    ]


@pytest.mark.parametrize("named", [True, False], ids=["event-lines", "data-only"])
def test_messages_ttft_is_the_first_content_block_delta_with_content(named: bool) -> None:
    rec = RequestRecord(sent_at=0.0, status=200)
    r = MessagesRecorder(rec)
    for t, event in enumerate(_messages(named)):
        r.feed(event, t / 100)
    r.close(0.1)
    assert rec.ok, rec.error
    assert rec.chunk_times == pytest.approx([0.04, 0.06])
    # Output tokens from message_delta (message_start's is a placeholder), input from the start.
    assert (rec.usage_completion_tokens, rec.usage_prompt_tokens) == (4, 9)
    assert rec.finish_reason == "tool_use"


def test_a_messages_error_event_or_a_stream_without_message_stop_is_an_error() -> None:
    rec = RequestRecord(sent_at=0.0, status=200)
    r = MessagesRecorder(rec)
    r.feed(b"".join(_messages(True)[:5]), 0.01)
    r.close(0.02)
    assert not rec.ok and "message_stop" in (rec.error or "")
    rec = RequestRecord(sent_at=0.0, status=200)
    r = MessagesRecorder(rec)
    r.feed(_ev("error", {"error": {"type": "overloaded_error", "message": "Overloaded"}}), 0.01)
    r.close(0.02)
    assert rec.error == "stream error: Overloaded"


def test_each_api_has_its_endpoint_body_and_headers() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    req = ChatRequest("m", msgs, max_tokens=5, temperature=0.5)
    assert api_url("responses", "http://h:1") == "http://h:1/v1/responses"
    assert api_url("messages", "http://h:1/v1/") == "http://h:1/v1/messages"
    assert api_url("chat", "http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"
    assert orjson.loads(responses_body(req)) == {
        "model": "m",
        "input": msgs,
        "stream": True,
        "max_output_tokens": 5,
        "temperature": 0.5,
    }
    assert orjson.loads(messages_body(req)) == {
        "model": "m",
        "messages": msgs[1:],
        "system": "Be brief.",
        "max_tokens": 5,
        "stream": True,
        "temperature": 0.5,
    }
    assert orjson.loads(messages_body(ChatRequest("m", msgs[1:])))["max_tokens"] == 4096
    assert auth_headers("messages", "k") == {"anthropic-version": "2023-06-01", "x-api-key": "k"}
    assert auth_headers("responses", "k") == {"Authorization": "Bearer k"}
