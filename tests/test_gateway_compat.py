"""The official openai SDK through the gateway gets what it gets from the upstream directly,
and every body and chunk is valid against the OpenAI schemas."""

from __future__ import annotations

import aiohttp
import openai
import orjson
import pytest

from tests import procs
from tests.sse_client import post_stream

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about pipes."},
]


def _client(service: procs.Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)


def _stream_text(client: openai.OpenAI) -> tuple[str, openai.types.CompletionUsage | None, int]:
    stream = client.chat.completions.create(
        model="sim-model",
        messages=MESSAGES,
        stream=True,
        max_tokens=12,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    text, usage, chunks = "", None, 0
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    return text, usage, chunks


def test_sdk_streaming_through_gateway_matches_upstream(
    sim: procs.Service, gateway: procs.Service
) -> None:
    direct = _stream_text(_client(sim))
    via = _stream_text(_client(gateway))
    assert via[0] == direct[0] and len(via[0].split()) == 12
    assert via[1] is not None and direct[1] is not None
    assert via[1].model_dump() == direct[1].model_dump()
    assert via[1].completion_tokens == 12


def test_sdk_non_streaming_through_gateway_matches_upstream(
    sim: procs.Service, gateway: procs.Service
) -> None:
    def ask(c: openai.OpenAI) -> openai.types.chat.ChatCompletion:
        return c.chat.completions.create(
            model="sim-model",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=7,
        )

    direct, via = ask(_client(sim)), ask(_client(gateway))
    assert via.choices[0].message.content == direct.choices[0].message.content
    assert via.usage == direct.usage and via.usage is not None and via.usage.completion_tokens == 7
    assert via.choices[0].finish_reason == "length"


def test_sdk_text_completions_stream_and_not(sim: procs.Service, gateway: procs.Service) -> None:
    c, d = _client(gateway), _client(sim)
    full = c.completions.create(model="sim-model", prompt="once upon a time", max_tokens=9)
    assert (
        full.choices[0].text
        == d.completions.create(model="sim-model", prompt="once upon a time", max_tokens=9)
        .choices[0]
        .text
    )
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model="sim-model", prompt="once upon a time", max_tokens=9, stream=True
        )
        if ch.choices
    )
    assert streamed == full.choices[0].text


def test_usage_chunk_only_when_asked(gateway: procs.Service) -> None:
    """The gateway asks the upstream for usage (for its metrics) but the client that did not
    ask must not see the usage chunk or `usage` fields."""
    stream = _client(gateway).chat.completions.create(
        model="sim-model", messages=MESSAGES, stream=True, max_tokens=5
    )  # type: ignore[arg-type]
    chunks = list(stream)
    assert chunks and all(ch.choices for ch in chunks)
    assert all(ch.usage is None for ch in chunks)


async def test_every_streamed_chunk_is_schema_valid(
    gateway: procs.Service, openai_schemas: object
) -> None:
    for usage in (False, True):
        body = {
            "model": "sim-model",
            "messages": MESSAGES,
            "stream": True,
            "max_tokens": 6,
            "stream_options": {"include_usage": usage},
        }
        r = await post_stream(gateway.url + "/v1/chat/completions", body)
        assert r.status == 200 and r.done
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert len(r.text.split()) == 6
        for chunk in r.chunks:
            openai_schemas.validate("CreateChatCompletionStreamResponse", chunk)  # type: ignore[attr-defined]
        assert (r.usage is not None) == usage


async def test_non_stream_bodies_are_schema_valid(
    gateway: procs.Service, openai_schemas: object
) -> None:
    v = openai_schemas.validate  # type: ignore[attr-defined]
    r = await post_stream(
        gateway.url + "/v1/chat/completions",
        {"model": "sim-model", "messages": MESSAGES, "max_tokens": 3},
    )
    v("CreateChatCompletionResponse", orjson.loads(r.body))
    r = await post_stream(
        gateway.url + "/v1/completions", {"model": "sim-model", "prompt": "hi", "max_tokens": 3}
    )
    v("CreateCompletionResponse", orjson.loads(r.body))
    models = _client(gateway).models.list()
    assert [m.id for m in models.data] == ["sim-model"]


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
async def test_health_endpoints_answer_ok(gateway: procs.Service, path: str) -> None:
    async with aiohttp.ClientSession() as s, s.get(gateway.url + path) as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] in ("ok", "ready")
