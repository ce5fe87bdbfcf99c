"""POST /v1/responses through the gateway, with the official SDK as the client: passed through
to an upstream that serves the Responses API (`upstreams[].responses: native`, the sim), and
translated to and from chat completions for one that does not (`responses: chat`: the sim's
chat, the embedded model). Every event is checked against the SDK's types and the OpenAI spec.
(`auto`, the default, is tests/test_responses_probe.py.)"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from tests import procs
from tests.polling import metrics, until
from tests.responses_events import check_events, check_response, parse, text_of
from tests.sse_client import unchunk
from tokenpipe.dialects.openai_schema import MAX_MESSAGES

INSTRUCTIONS = "You are terse."
QUESTION = "Tell me about pipes."
CHAT_MESSAGES = [
    {"role": "system", "content": INSTRUCTIONS},
    {"role": "user", "content": QUESTION},
]


@pytest.fixture(scope="module")
def native_gateway(sim: procs.Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    cfg = tmp_path_factory.mktemp("native") / "gw.yaml"
    cfg.write_text(f"upstreams:\n  - {{name: sim, url: '{sim.url}/v1', responses: native}}\n")
    with procs.gateway("--config", str(cfg)) as g:
        yield g


@pytest.fixture(scope="module")
def chat_gateway(sim: procs.Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    cfg = tmp_path_factory.mktemp("chat") / "gw.yaml"
    cfg.write_text(f"upstreams:\n  - {{name: upstream0, url: '{sim.url}/v1', responses: chat}}\n")
    with procs.gateway("--config", str(cfg)) as g:
        yield g


@pytest.fixture(params=["native", "chat"])
def way(
    request: pytest.FixtureRequest, native_gateway: procs.Service, chat_gateway: procs.Service
) -> tuple[str, procs.Service]:
    """Each way a Responses request goes: (name, the gateway that sends it that way)."""
    return request.param, native_gateway if request.param == "native" else chat_gateway


def _client(service: procs.Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)


async def _stream(gw: procs.Service, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The raw events of a streamed Responses request."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/responses", json={**body, "stream": True}) as r,
    ):
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        return parse(await r.read())


def _upstream_answer(sim: procs.Service, way: str, **extra: Any) -> tuple[str, dict[str, int]]:
    """What the sim itself answers the request each way: (text, usage in chat's shape)."""
    c = _client(sim)
    if way == "native":
        r = c.responses.create(
            model="sim-model", instructions=INSTRUCTIONS, input=QUESTION, **extra
        )
        assert r.usage is not None
        usage = {"prompt_tokens": r.usage.input_tokens, "completion_tokens": r.usage.output_tokens}
        return r.output_text, usage
    if "max_output_tokens" in extra:
        extra["max_tokens"] = extra.pop("max_output_tokens")
    chat = c.chat.completions.create(model="sim-model", messages=CHAT_MESSAGES, **extra)  # type: ignore[call-overload]
    assert chat.usage is not None
    text = chat.choices[0].message.content or ""
    usage = {
        "prompt_tokens": chat.usage.prompt_tokens,
        "completion_tokens": chat.usage.completion_tokens,
    }
    return text, usage


def _usage(r: openai.types.responses.Response) -> dict[str, int]:
    assert r.usage is not None
    return {"prompt_tokens": r.usage.input_tokens, "completion_tokens": r.usage.output_tokens}


def test_create_gives_the_upstreams_text_and_usage(
    sim: procs.Service, way: tuple[str, procs.Service]
) -> None:
    name, gw = way
    want_text, want_usage = _upstream_answer(sim, name)
    raw = _client(gw).responses.with_raw_response.create(
        model="sim-model", instructions=INSTRUCTIONS, input=QUESTION
    )
    got = check_response(json.loads(raw.content))
    assert got.status == "completed" and got.instructions == INSTRUCTIONS
    assert got.output_text == want_text and len(want_text.split()) == 20
    assert _usage(got) == want_usage


def test_stream_gives_the_upstreams_text_and_usage_in_valid_events(
    sim: procs.Service, way: tuple[str, procs.Service]
) -> None:
    name, gw = way
    want_text, want_usage = _upstream_answer(sim, name)
    with _client(gw).responses.stream(
        model="sim-model", instructions=INSTRUCTIONS, input=QUESTION
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == want_text == final.output_text
    assert _usage(final) == want_usage
    events = asyncio.run(_stream(gw, {"model": "sim-model", "input": QUESTION}))
    check_events(events)
    assert events[-1]["type"] == "response.completed"
    check_response(events[-1]["response"])
    types = [e["type"] for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert (
        done["text"] == text_of(events) == events[-1]["response"]["output"][0]["content"][0]["text"]
    )


def test_max_output_tokens_ends_incomplete_both_streamed_and_not(
    sim: procs.Service, way: tuple[str, procs.Service]
) -> None:
    name, gw = way
    want_text, want_usage = _upstream_answer(sim, name, max_output_tokens=5)
    got = _client(gw).responses.create(
        model="sim-model", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=5
    )
    assert got.status == "incomplete" and got.incomplete_details is not None
    assert got.incomplete_details.reason == "max_output_tokens"
    assert got.output_text == want_text and _usage(got) == want_usage
    body = {"model": "sim-model", "instructions": INSTRUCTIONS, "input": QUESTION}
    events = asyncio.run(_stream(gw, {**body, "max_output_tokens": 5}))
    check_events(events)
    assert events[-1]["type"] == "response.incomplete"
    assert text_of(events) == want_text
    assert events[-1]["response"]["usage"]["output_tokens"] == 5


TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"words": {"type": "string"}}},
    }
]


def test_function_tools_reach_the_upstream_and_their_calls_come_back(
    sim: procs.Service, way: tuple[str, procs.Service]
) -> None:
    """The sim calls a forced tool with `{"words": ...}`: the call proves the tools and the
    tool_choice arrived, its items that the answer came back, streamed or not."""
    _, gw = way
    got = _client(gw).responses.create(
        model="sim-model",
        input=QUESTION,
        tools=TOOLS,
        tool_choice="required",  # type: ignore[arg-type]
    )
    calls = [o for o in got.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert len(json.loads(calls[0].arguments)["words"].split()) == 20
    body = {"model": "sim-model", "input": QUESTION, "tools": TOOLS}
    events = asyncio.run(
        _stream(gw, {**body, "tool_choice": {"type": "function", "name": "get_weather"}})
    )
    check_events(events)
    args = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == args == calls[0].arguments and done["name"] == "get_weather"
    item = events[-1]["response"]["output"][0]
    assert item["type"] == "function_call" and item["arguments"] == args


def test_a_function_call_and_its_output_are_sent_as_chat_tool_messages(
    sim: procs.Service, chat_gateway: procs.Service
) -> None:
    """The second turn of a tool loop: the sim's words follow the last message it was sent,
    so the same text as the chat request with the tool messages proves their translation."""
    first = _client(chat_gateway).responses.create(
        model="sim-model",
        input=QUESTION,
        tools=TOOLS,
        tool_choice="required",  # type: ignore[arg-type]
    )
    call = first.output[0]
    assert call.type == "function_call"
    output = "sunny and warm in lisbon"
    turn = [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": output},
    ]
    got = _client(chat_gateway).responses.create(model="sim-model", input=turn, tools=TOOLS)  # type: ignore[arg-type]
    direct = _client(sim).chat.completions.create(
        model="sim-model",
        messages=[
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": output},
        ],
    )
    assert got.output_text == direct.choices[0].message.content
    assert direct.usage is not None and _usage(got)["prompt_tokens"] == direct.usage.prompt_tokens


def _open_stream(port: int, content: str, rid: str, rcvbuf: int | None = None) -> socket.socket:
    body = orjson.dumps({"model": "sim-model", "stream": True, "input": content})
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nx-request-id: "
        + rid.encode()
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    return sock


async def test_a_slow_reader_gets_merged_deltas_with_identical_text(
    way: tuple[str, procs.Service],
) -> None:
    name, gw = way
    content = "[[sim itl_ms=1 output_tokens=1000]] a long answer please"

    def read(rid: str, slow: bool) -> bytes:
        s = _open_stream(gw.port, content, rid, rcvbuf=4096 if slow else None)
        out = b""
        while chunk := s.recv(1024 if slow else 1 << 20):
            out += chunk
            if slow:
                time.sleep(0.02)  # the client's own slowness, not synchronisation
        s.close()
        return out

    fast = parse(unchunk(await asyncio.to_thread(read, f"fast-{name}", False)))
    slow = parse(unchunk(await asyncio.to_thread(read, f"slow-{name}", True)))
    for events in (fast, slow):
        check_events(events, schema_too=False)  # the SDK's types for all; the spec below
    deltas = [e for e in slow if e["type"] == "response.output_text.delta"]
    check_events([slow[0], *deltas[:50], slow[-1]])
    assert len(text_of(fast).split()) == 1000
    assert text_of(slow) == text_of(fast)  # byte for byte: nothing lost, reordered or added
    fast_deltas = sum(e["type"] == "response.output_text.delta" for e in fast)
    assert len(deltas) < fast_deltas / 2  # merged into fewer, larger events
    assert slow[-1]["response"]["output"][0]["content"][0]["text"] == text_of(slow)


async def test_a_client_that_disconnects_closes_the_upstream_at_once(
    sim: procs.Service, way: tuple[str, procs.Service]
) -> None:
    name, gw = way
    rid = f"responses-disconnect-{name}"
    sock = _open_stream(gw.port, "[[sim itl_ms=20 output_tokens=1000]] go on", rid)
    received = b""
    sock.settimeout(10)
    while b"response.output_text.delta" not in received:
        data = sock.recv(65536)
        assert data, "the gateway closed the stream"
        received += data
    closed_at = time.monotonic()
    sock.close()

    async def ended() -> dict[str, Any] | None:
        async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/stats?last=1000") as r:
            recs = (await r.json())["records"]
        rec = next((r for r in recs if r["id"] == rid), None)
        return rec if rec and rec["outcome"] != "running" else None

    rec = await until(ended, 5, "the sim to see the disconnect")
    assert rec["outcome"] == "cancelled"
    assert rec["ended"] - closed_at < 0.100


async def test_a_cut_stream_ends_with_the_responses_error_event(
    way: tuple[str, procs.Service],
) -> None:
    _, gw = way
    events = await _stream(gw, {"model": "sim-model", "input": "[[sim fault=truncate:3]] hi"})
    check_events(events)
    assert events[-1]["type"] == "error"
    assert "The answer is incomplete" in events[-1]["message"]
    assert len(text_of(events).split()) == 3


@pytest.mark.parametrize("name", ["native", "chat"])
async def test_a_stream_cut_by_shutdown_ends_with_the_responses_error_event(
    sim: procs.Service, tmp_path: Path, name: str
) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "server: {drain_seconds: 0.5}\n"
        f"upstreams:\n  - {{name: sim, url: '{sim.url}/v1', responses: {name}}}\n"
    )
    body = {"model": "sim-model", "stream": True, "input": "[[sim itl_ms=50 output_tokens=400]] go"}
    with procs.gateway("--config", str(cfg)) as g:
        async with (
            aiohttp.ClientSession() as s,
            s.post(g.url + "/v1/responses", json=body) as r,
        ):
            head = await r.content.readuntil(b"response.output_text.delta")
            g.signal(signal.SIGTERM)
            rest = await r.content.read()
    events = parse(head + rest)
    check_events(events)
    assert events[-1]["type"] == "error" and events[-1]["code"] == "shutdown"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"store": True}, "store"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_what_chat_cannot_express_is_a_400_naming_the_field(
    chat_gateway: procs.Service, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "sim-model", "input": QUESTION, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        _client(chat_gateway).post("/responses", cast_to=object, body=body)
    error = e.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert param in error["message"]


@pytest.fixture(scope="module")
def hedged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, procs.Service]]:
    """A sim whose first token always stalls 3 s, a healthy one, and a gateway over both for
    each way (in that order; hedging after 0.1 s, to the other upstream)."""
    with (
        procs.sim("--ttft-ms", "5", "--itl-ms", "1", "--fault", "stall-first:3000@1") as slow,
        procs.sim("--ttft-ms", "5", "--itl-ms", "1") as fast,
    ):
        gateways = {}
        root = tmp_path_factory.mktemp("hedged")
        for name in ("native", "chat"):
            cfg = root / f"{name}.yaml"
            cfg.write_text(
                "upstreams:\n"
                f"  - {{name: slow, url: '{slow.url}/v1', responses: {name}}}\n"
                f"  - {{name: fast, url: '{fast.url}/v1', responses: {name}}}\n"
                "tail: {hedging: {initial_delay_seconds: 0.1, budget_ratio: 1}}\n"
            )
            gateways[name] = procs.gateway("--config", str(cfg))
        try:
            yield gateways
        finally:
            for g in gateways.values():
                g.stop()


@pytest.mark.parametrize("name", ["native", "chat"])
def test_a_hedge_that_wins_before_content_is_the_one_response_the_client_sees(
    hedged: dict[str, procs.Service], name: str
) -> None:
    """The stalled response's start is held back until content: the client sees one response
    (one id, as the SDK checks), the hedge's."""
    gw = hedged[name]
    with _client(gw).responses.stream(model="sim-model", input=QUESTION) as stream:
        final = stream.get_final_response()
    assert len(final.output_text.split()) == 64
    events = asyncio.run(_stream(gw, {"model": "sim-model", "input": QUESTION}))
    check_events(events)
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1
    won = sample(asyncio.run(metrics(gw)), "tokenpipe_hedges_total", outcome="won")
    assert won == 2


def sample(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sample `name{labels}` (in any label order; 0 when there is none yet)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and set(rest.rstrip("}").split(",")) == want:
            return value
    return 0.0


async def test_responses_are_counted_like_chat(chat_gateway: procs.Service) -> None:
    labels = {"api": "responses", "model": "sim-model", "upstream": "upstream0"}
    before = await metrics(chat_gateway)
    _client(chat_gateway).responses.create(model="sim-model", input=QUESTION)
    await _stream(chat_gateway, {"model": "sim-model", "input": QUESTION})
    after = await metrics(chat_gateway)
    for name, extra, grew in [
        ("tokenpipe_requests_total", {"status": "200"}, 2),
        ("tokenpipe_tokens_total", {"kind": "completion"}, 40),  # 20 each, from usage
        ("tokenpipe_ttft_seconds_count", {}, 1),  # the streamed one
    ]:
        was = sample(before, name, **labels, **extra)
        assert sample(after, name, **labels, **extra) == was + grew, name


@pytest.mark.local
def test_the_embedded_model_answers_the_responses_api(tmp_path: Path) -> None:
    """As `make run` serves it (no upstream: the local model, reached through chat). Small:
    the model is slow on CPU."""
    from tokenpipe.engines.local.model import installed

    if not installed():
        pytest.skip("the `local` extra is not installed")
    with procs.Service(
        "serve", "--port", "0", "--grpc-port", "0", name="make-run-responses", timeout=120
    ) as gw:
        body = {"model": "gemma-3-270m", "input": "Say hello.", "max_output_tokens": 6}
        whole = check_response(
            json.loads(_client(gw).responses.with_raw_response.create(**body).content)  # type: ignore[arg-type]
        )
        assert whole.status in ("completed", "incomplete") and whole.output_text
        assert whole.usage is not None and 0 < whole.usage.output_tokens <= 6
        events = asyncio.run(_stream(gw, body))
    check_events(events)
    final = events[-1]["response"]
    assert text_of(events) == final["output"][0]["content"][0]["text"]
    assert 0 < final["usage"]["output_tokens"] <= 6


def test_an_input_past_the_items_bound_is_a_400_either_way(way: tuple[str, Any]) -> None:
    """10,001 input items are refused at once, natively and translated. Before, a translated
    request made a chat message of each before chat's bound refused it (140,000 small items
    in 4 MiB: 89 ms of the event loop), and a native one was passed on with no bound."""
    _, gateway = way
    items = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    body = {"model": "sim-model", "input": items}
    with pytest.raises(openai.BadRequestError) as e:
        _client(gateway).post("/responses", cast_to=object, body=body)
    error = e.value.body
    assert isinstance(error, dict) and error["param"] == "input", error
