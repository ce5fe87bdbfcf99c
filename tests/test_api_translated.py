"""Translation between APIs on real loopback sockets, with the official SDKs as clients: an
Anthropic client on an OpenAI chat upstream, and an OpenAI chat client on an Anthropic
upstream (the sim speaks both). Every streamed event and body validates against the client
SDK's own types; text, tool calls and usage equal what the upstream produced; what the other
API cannot express is a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionChunk

from tests import procs
from tests.test_api_messages import WEATHER, raw_events, words

PROMPT = "Tell me something about the sea"
FUNCTION = {
    "type": "function",
    "function": {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    },
}


@pytest.fixture(scope="module")
def on_openai(sim: procs.Service) -> Iterator[procs.Service]:
    """The gateway with only an OpenAI upstream (the shared sim)."""
    with procs.gateway("--upstream", sim.url + "/v1") as g:
        yield g


@pytest.fixture(scope="module")
def on_anthropic(sim: procs.Service) -> Iterator[procs.Service]:
    """The gateway with only an Anthropic upstream (the shared sim's /v1/messages)."""
    with procs.gateway("--upstream", "anthropic+" + sim.url + "/v1") as g:
        yield g


def _direct_chat(sim: procs.Service, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "sim-model",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}],
    }
    r = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200
    return r.json()  # type: ignore[no-any-return]


# -- an Anthropic client on an OpenAI upstream -------------------------------------------------


def test_messages_on_a_chat_upstream_whole_and_streamed(
    on_openai: procs.Service, sim: procs.Service
) -> None:
    direct = _direct_chat(sim, PROMPT, 100)
    text = direct["choices"][0]["message"]["content"]
    with anthropic.Anthropic(base_url=on_openai.url, api_key="k", max_retries=0) as c:
        m = c.messages.create(
            model="sim-model", max_tokens=100, messages=[{"role": "user", "content": PROMPT}]
        )
        assert [b.type for b in m.content] == ["text"]
        assert m.content[0].text == text  # type: ignore[union-attr]
        assert m.usage.output_tokens == direct["usage"]["completion_tokens"]
        finish = direct["choices"][0]["finish_reason"]
        assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish]
        with c.messages.stream(
            model="sim-model", max_tokens=100, messages=[{"role": "user", "content": PROMPT}]
        ) as stream:
            final = stream.get_final_message()
    assert final.content[0].text == text  # type: ignore[union-attr]
    assert final.usage.output_tokens == direct["usage"]["completion_tokens"]
    body = {
        "model": "sim-model",
        "max_tokens": 100,
        "stream": True,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    events = raw_events(on_openai.url, body, {"x-api-key": "k"})  # each validated
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    deltas = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(deltas) == text


def test_messages_fields_chat_cannot_express_are_anthropics_400(on_openai: procs.Service) -> None:
    with (
        anthropic.Anthropic(base_url=on_openai.url, api_key="k", max_retries=0) as c,
        pytest.raises(anthropic.BadRequestError) as e,
    ):
        c.messages.create(
            model="sim-model",
            max_tokens=10,
            extra_body={"top_k": 5},
            messages=[{"role": "user", "content": PROMPT}],
        )
    body: Any = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "top_k" in body["error"]["message"]


# -- an OpenAI chat client on an Anthropic upstream --------------------------------------------


def test_chat_on_a_messages_upstream_whole_and_streamed(on_anthropic: procs.Service) -> None:
    with openai.OpenAI(base_url=on_anthropic.url + "/v1", api_key="k", max_retries=0) as c:
        done = c.chat.completions.create(
            model="sim-model", max_tokens=100, messages=[{"role": "user", "content": PROMPT}]
        )
        assert done.choices[0].message.content == words(PROMPT, 20)
        assert done.choices[0].finish_reason == "stop"
        assert done.usage is not None and done.usage.completion_tokens == 20
        chunks = list(
            c.chat.completions.create(
                model="sim-model",
                max_tokens=100,
                stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": PROMPT}],
            )
        )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == words(PROMPT, 20)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20


def test_a_streamed_tool_call_on_a_messages_upstream_arrives_as_chat_tool_calls(
    on_anthropic: procs.Service,
) -> None:
    prompt = PROMPT + " [[sim tool=get_weather]]"
    body = {
        "model": "sim-model",
        "max_tokens": 100,
        "stream": True,
        "tools": [FUNCTION],
        "messages": [{"role": "user", "content": prompt}],
    }
    chunks = []
    with httpx.stream(
        "POST", on_anthropic.url + "/v1/chat/completions", json=body, timeout=30
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(ChatCompletionChunk.model_validate(orjson.loads(line[6:])))
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
    assert calls and calls[0].function is not None and calls[0].function.name == "get_weather"
    args = "".join(tc.function.arguments or "" for tc in calls if tc.function is not None)
    assert set(orjson.loads(args)) == {"text"}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_chat_fields_messages_cannot_express_are_a_400_naming_the_field(
    on_anthropic: procs.Service,
) -> None:
    with (
        openai.OpenAI(base_url=on_anthropic.url + "/v1", api_key="k", max_retries=0) as c,
        pytest.raises(openai.BadRequestError) as e,
    ):
        c.chat.completions.create(
            model="sim-model",
            presence_penalty=0.5,
            messages=[{"role": "user", "content": PROMPT}],
        )
    body: Any = e.value.body
    assert body["param"] == "presence_penalty"
