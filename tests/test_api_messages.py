"""Anthropic's Messages API through the gateway to `tokenpipe sim` on real loopback sockets,
with the official `anthropic` SDK as the client: answers whole and streamed (with and without
tools), every streamed event valid against the SDK's own types, text, tool calls and usage as
the sim produced them; auth by x-api-key; errors in Anthropic's shape."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from pydantic import TypeAdapter

from tests import procs
from tests.server_timing import timing_comment
from tokenpipe import sse
from tokenpipe.engines.sim import text as sim_text

EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)
KEY = "sk-test-messages"
PROMPT = "Tell me something about the sea"
WEATHER = {
    "name": "get_weather",
    "description": "The weather at a place.",
    "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}},
}


def words(prompt: str, n: int) -> str:
    """What the sim answers to `prompt` (its last message): n seeded words."""
    return "".join(islice(sim_text.words(0, prompt), n))


def input_tokens(prompt: str, messages: int = 1) -> int:
    """The sim's count of a request's input tokens (engines/sim/messages.py)."""
    return sim_text.count_tokens(prompt) + 4 * messages + 3


@pytest.fixture(scope="module")
def gateway(sim: procs.Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The gateway with one Anthropic upstream (the shared sim: 20 words per answer) and
    one client key."""
    cfg = tmp_path_factory.mktemp("messages") / "gw.yaml"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    cfg.write_text(
        f"auth:\n  api_keys:\n    - name: team\n      sha256: {digest}\n"
        f"upstreams:\n  - name: claude\n    api: anthropic\n    url: {sim.url}/v1\n"
    )
    with procs.gateway("--config", str(cfg)) as g:
        yield g


@pytest.fixture
def client(gateway: procs.Service) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as c:
        yield c


def raw_events(url: str, body: dict[str, Any], headers: dict[str, str]) -> list[dict[str, Any]]:
    """The stream's events as sent, each checked: its `event:` line names its type, and it
    is valid against the SDK's RawMessageStreamEvent (ping and error are outside that union)."""
    out = []
    with httpx.stream("POST", url + "/v1/messages", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"] == "text/event-stream"
        dec = sse.SSEDecoder()
        for chunk in r.iter_bytes():
            for ev in dec.feed(chunk):
                if timing_comment(ev):  # the gateway's Server-Timing, its only comment
                    continue
                obj = orjson.loads(ev.data)
                assert ev.event == obj["type"], ev
                if obj["type"] not in ("ping", "error"):
                    EVENT.validate_python(obj)
                out.append(obj)
    return out


def test_create_answers_the_sims_message_with_its_usage(
    client: anthropic.Anthropic, sim: procs.Service
) -> None:
    m = client.messages.create(
        model="sim-model", max_tokens=100, messages=[{"role": "user", "content": PROMPT}]
    )
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "end_turn"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == words(PROMPT, 20)  # type: ignore[union-attr]
    assert (m.usage.input_tokens, m.usage.output_tokens) == (input_tokens(PROMPT), 20)
    stats = httpx.get(sim.url + "/sim/stats?last=1").json()["records"][-1]
    assert stats["kind"] == "messages" and stats["tokens"] == 20


def test_a_streamed_answer_is_valid_event_by_event_and_counted_in_the_metrics(
    gateway: procs.Service, client: anthropic.Anthropic
) -> None:
    prompt = PROMPT + " [[sim output_tokens=30]]"
    before = _tokens(gateway)
    body = {
        "model": "sim-model",
        "max_tokens": 30,
        "stream": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    events = raw_events(gateway.url, body, {"x-api-key": KEY})
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("ping") == 1
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert {e["index"] for e in deltas} == {0} and 1 <= len(deltas) <= 30
    assert "".join(e["delta"]["text"] for e in deltas) == words(prompt, 30)
    assert events[0]["message"]["usage"]["input_tokens"] == input_tokens(prompt)
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2]["usage"]["output_tokens"] == 30
    # Usage joined across message_start and message_delta: both counted.
    after = _tokens(gateway)
    assert after["prompt"] - before["prompt"] == input_tokens(prompt)
    assert after["completion"] - before["completion"] == 30
    # The SDK's own stream helper reads the same answer.
    with client.messages.stream(
        model="sim-model", max_tokens=30, messages=[{"role": "user", "content": prompt}]
    ) as stream:
        assert "".join(stream.text_stream) == words(prompt, 30)
        final = stream.get_final_message()
    assert final.usage.output_tokens == 30 and final.stop_reason == "max_tokens"


def test_a_streamed_tool_call_arrives_whole(
    gateway: procs.Service, client: anthropic.Anthropic
) -> None:
    prompt = PROMPT + " [[sim tool=get_weather]]"
    messages: Any = [{"role": "user", "content": prompt}]
    with client.messages.stream(
        model="sim-model", max_tokens=100, messages=messages, tools=[WEATHER]
    ) as stream:
        final = stream.get_final_message()
    said = words(prompt, 20)
    first_half = "".join(islice(sim_text.words(0, prompt), 10))
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == [
        "text",
        "tool_use",
    ]
    assert final.content[0].text == first_half  # type: ignore[union-attr]
    tool = final.content[1]
    assert tool.type == "tool_use" and tool.name == "get_weather" and tool.id.startswith("toolu_")
    assert tool.input == {"text": said[len(first_half) :]}
    # As sent: the tool's input in parts, one per word (plus the closing one), never merged.
    body = {"model": "sim-model", "max_tokens": 100, "stream": True, "messages": messages}
    events = raw_events(gateway.url, {**body, "tools": [WEATHER]}, {"x-api-key": KEY})
    parts = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert len(parts) == 11 and orjson.loads("".join(parts)) == tool.input
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1]
    # Not streamed: the same blocks.
    m = client.messages.create(
        model="sim-model", max_tokens=100, messages=messages, tools=[WEATHER]
    )
    assert [_block(b) for b in m.content] == [_block(b) for b in final.content]


def test_count_tokens_is_passed_through(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(
        model="sim-model", messages=[{"role": "user", "content": PROMPT}]
    )
    assert counted.input_tokens == input_tokens(PROMPT)


def test_keys_by_x_api_key_or_bearer_and_a_bad_key_gets_anthropics_401(
    gateway: procs.Service,
) -> None:
    ask: Any = {
        "model": "sim-model",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with anthropic.Anthropic(base_url=gateway.url, auth_token=KEY, max_retries=0) as bearer:
        assert bearer.messages.create(**ask).usage.output_tokens == 5
    with (
        anthropic.Anthropic(base_url=gateway.url, api_key="sk-wrong", max_retries=0) as bad,
        pytest.raises(anthropic.AuthenticationError) as e,
    ):
        bad.messages.create(**ask)
    assert e.value.status_code == 401
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Incorrect API key provided."},
    }
    r = httpx.post(gateway.url + "/v1/messages", json=ask)  # no key at all
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in r.json()["error"]["message"]


INVALID = "invalid_request_error"


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "kind"),
    [
        ("POST", "/v1/messages", {"model": "sim-model", "messages": []}, 400, INVALID),
        ("POST", "/v1/messages", {"model": "m", "max_tokens": "5", "messages": []}, 400, INVALID),
        ("POST", "/v1/messages/count_tokens", {"model": "sim-model"}, 400, INVALID),
        # A content block without its `type` (Anthropic's API requires it), a tool not an object
        ("POST", "/v1/messages", {"model": "sim-model", "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"text": "hi"}]}]}, 400, INVALID),
        ("POST", "/v1/messages", {"model": "sim-model", "max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"}], "tools": ["f"]}, 400, INVALID),
        ("GET", "/v1/messages", None, 405, INVALID),
    ],
)  # fmt: skip
def test_errors_before_the_upstream_are_anthropic_shaped(
    gateway: procs.Service, method: str, path: str, body: Any, status: int, kind: str
) -> None:
    r = httpx.request(method, gateway.url + path, json=body, headers={"x-api-key": KEY})
    assert r.status_code == status
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == kind, got
    assert set(got) == {"type", "error"} and set(got["error"]) == {"type", "message"}


def test_a_model_no_upstream_serves_is_anthropics_404_one_only_openai_serves_is_translated(
    tmp_path: Path,
) -> None:
    with procs.sim("--model", "sim-model", "--model", "claude-x", "--strict-models") as sim:
        cfg = tmp_path / "gw.yaml"  # sim-model is served, but by an OpenAI upstream only
        cfg.write_text(
            f"upstreams:\n  - name: oa\n    url: {sim.url}/v1\n    models: [sim-model]\n"
            f"  - name: claude\n    api: anthropic\n    url: {sim.url}/v1\n    models: [claude-x]\n"
        )
        with (
            procs.gateway("--config", str(cfg)) as gw,
            anthropic.Anthropic(base_url=gw.url, api_key="k", max_retries=0) as c,
        ):
            with pytest.raises(anthropic.NotFoundError) as e:
                c.messages.create(
                    model="nobody-serves",
                    max_tokens=5,
                    messages=[{"role": "user", "content": "hi"}],
                )
            assert e.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
            ok = c.messages.create(
                model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            )
            assert ok.usage.output_tokens == 5
            # On the OpenAI upstream by translation (tests/test_api_translated.py for more).
            moved = c.messages.create(
                model="sim-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            )
            assert moved.usage.output_tokens == 5 and moved.content[0].type == "text"


def test_a_stream_cut_mid_way_ends_with_anthropics_error_event(
    gateway: procs.Service, client: anthropic.Anthropic
) -> None:
    prompt = "[[sim fault=reset:5]] " + PROMPT
    body = {
        "model": "sim-model",
        "max_tokens": 50,
        "stream": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    events = raw_events(gateway.url, body, {"x-api-key": KEY})
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
    assert "after 5 content deltas" in events[-1]["error"]["message"]
    assert not any(e["type"] == "message_stop" for e in events)
    with (
        pytest.raises(anthropic.APIStatusError),  # the SDK raises at the error event
        client.messages.stream(
            model="sim-model", max_tokens=50, messages=[{"role": "user", "content": prompt}]
        ) as stream,
    ):
        for _ in stream:
            pass


def _block(b: Any) -> tuple[Any, ...]:
    """A content block but its id (the sim's ids are per request)."""
    return (b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))


def _tokens(gw: procs.Service) -> dict[str, float]:
    m = {
        k: float(v)
        for k, v in (
            line.rsplit(" ", 1)
            for line in httpx.get(gw.url + "/metrics").text.splitlines()
            if line and not line.startswith("#")
        )
    }
    return {
        kind: sum(
            v
            for k, v in m.items()
            if k.startswith("tokenpipe_tokens_total{") and f'kind="{kind}"' in k
        )
        for kind in ("prompt", "completion")
    }
