"""Every request traced over OTLP/HTTP: real gateways in front of the sim export to a real OTLP
receiver on loopback (tests/otlp_receiver.py, the official opentelemetry-proto messages), and
the sim records the `traceparent` each upstream request carried. Privacy: no prompt or
completion text and no key in any exported byte unless content capture is opted into."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests import procs
from tests.otlp_receiver import Receiver, Span
from tests.polling import until
from tests.sse_client import post_stream

CLIENT_KEY = "sk-client-0f6c2d7e9a1b4c3d"
UPSTREAM_KEY = "sk-upstream-7b1e5a9c3d2f"
KEY_ENV = "TOKENPIPE_TEST_UPSTREAM_KEY"
AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}
#: A word no span may carry unless content capture is on.
SECRET_WORD = "okapisecretword"


def _config(tmp: Path, sim: procs.Service, name: str, capture: bool = False) -> str:
    digest = hashlib.sha256(CLIENT_KEY.encode()).hexdigest()
    path = tmp / f"{name}.yaml"
    path.write_text(
        "auth:\n"
        f"  api_keys: [{{name: tester, sha256: {digest}}}]\n"
        "upstreams:\n"
        f"  - {{name: sim, url: {sim.url}/v1, api_key_env: {KEY_ENV}}}\n"
        f"tracing: {{capture_content: {'true' if capture else 'false'}}}\n"
    )
    return str(path)


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture(scope="module")
def traced(
    receiver: Receiver, sim: procs.Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[procs.Service]:
    cfg = _config(tmp_path_factory.mktemp("traced"), sim, "traced")
    with procs.gateway("--config", cfg, env={**receiver.env(), KEY_ENV: UPSTREAM_KEY}) as g:
        yield g


def client_traceparent() -> tuple[str, str, str]:
    """A client's own trace: (trace id, its span id, the traceparent header)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


async def exported(receiver: Receiver, trace_id: str) -> list[Span]:
    """The trace's spans once its server span arrived (it ends last: the rest came first)."""

    async def server() -> list[Span] | None:
        spans = receiver.received.trace(trace_id)
        return spans if any(s.kind == "SERVER" for s in spans) else None

    spans: list[Span] = await until(server, 15, f"the server span of trace {trace_id}")
    return spans


async def sim_records(sim: procs.Service) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/stats?last=1000") as r:
        return list((await r.json())["records"])


def request_id_of(headers: dict[str, str]) -> str:
    return next(v for k, v in headers.items() if k.lower() == "x-request-id")


def _one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [(s.name, s.kind) for s in spans]
    return found[0]


async def test_a_streamed_chat_is_one_trace_continuing_the_clients_traceparent_to_the_upstream(
    traced: procs.Service, receiver: Receiver, sim: procs.Service
) -> None:
    trace_id, client_span, traceparent = client_traceparent()
    r = await post_stream(
        traced.url + "/v1/chat/completions",
        {
            "model": "sim-model",
            "stream": True,
            "max_tokens": 12,
            "messages": [{"role": "user", "content": "hello there"}],
            "stream_options": {"include_usage": True},
        },
        headers={**AUTH, "traceparent": traceparent, "tracestate": "vendor=abc"},
    )
    assert r.status == 200 and r.done, r.body
    spans = await exported(receiver, trace_id)
    assert all(s.trace_state == "vendor=abc" for s in spans)
    server = _one(spans, "POST /v1/chat/completions")
    assert server.kind == "SERVER" and server.parent_id == client_span
    assert server.resource["service.name"] == "tokenpipe-test"
    a = server.attributes
    assert a["http.response.status_code"] == 200 and a["tokenpipe.status"] == 200
    assert a["tokenpipe.request_id"] == request_id_of(r.headers)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "sim-model"
    assert a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.provider.name"] == "openai"
    assert a["gen_ai.response.model"] == "sim-model"
    assert r.usage is not None
    assert a["gen_ai.usage.input_tokens"] == r.usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == r.usage["completion_tokens"] == 12
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert 0 < a["gen_ai.server.time_to_first_token"] < 5
    assert a["tokenpipe.stream.deltas"] == 12 and a["tokenpipe.stream.events"] >= 1
    assert a["tokenpipe.stream.tokens_per_event"] >= 1
    assert a["tokenpipe.attempts"] == 1
    assert server.event("first_token") is not None

    # The children, each directly under the server span.
    kids = {s.name: s for s in spans if s is not server}
    assert set(kids) == {"admission", "context", "limiter wait", "chat sim-model"}, kids
    assert all(s.parent_id == server.span_id for s in kids.values())
    assert kids["admission"].kind == kids["context"].kind == "INTERNAL"
    assert kids["limiter wait"].attributes["tokenpipe.upstream.name"] == "sim"
    attempt = kids["chat sim-model"]
    assert attempt.kind == "CLIENT"
    b = attempt.attributes
    assert b["gen_ai.operation.name"] == "chat" and b["gen_ai.provider.name"] == "openai"
    assert b["gen_ai.request.model"] == "sim-model"
    assert b["server.address"] == "127.0.0.1" and b["server.port"] == sim.port
    assert b["tokenpipe.upstream.name"] == "sim" and b["tokenpipe.attempt.role"] == "first"
    assert b["tokenpipe.attempt.outcome"] == "answered"
    assert b["http.response.status_code"] == 200
    assert b["tokenpipe.limiter.wait_seconds"] >= 0
    assert attempt.event("first_token") is not None
    # Nested in time: the steps before the attempt, the attempt within the request.
    assert kids["admission"].end <= kids["context"].start <= kids["context"].end
    assert kids["limiter wait"].end <= attempt.start
    assert server.start <= attempt.start and attempt.end <= server.end

    # The upstream got the attempt span's context: the same trace, the attempt as parent.
    records = [x for x in await sim_records(sim) if x["id"] == request_id_of(r.headers)]
    assert [x["traceparent"] for x in records] == [f"00-{trace_id}-{attempt.span_id}-01"]


async def test_each_api_names_its_operation_and_each_request_is_a_trace_of_its_own(
    traced: procs.Service, receiver: Receiver
) -> None:
    calls = [
        (
            "/v1/chat/completions",
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            "chat",
        ),
        ("/v1/completions", {"max_tokens": 4, "prompt": "once upon a time"}, "text_completion"),
        ("/v1/embeddings", {"input": "embed me"}, "embeddings"),
        ("/v1/responses", {"max_output_tokens": 4, "input": "hi there"}, "chat"),
    ]
    ids: dict[str, str] = {}
    async with aiohttp.ClientSession() as s:
        for path, body, _ in calls:
            async with s.post(
                traced.url + path, json={"model": "sim-model", **body}, headers=AUTH
            ) as resp:
                assert resp.status == 200, await resp.text()
                ids[path] = resp.headers["x-request-id"]

    def servers() -> dict[str, Span]:
        return {
            str(sp.attributes.get("tokenpipe.request_id")): sp
            for sp in receiver.received.snapshot()
            if sp.kind == "SERVER"
        }

    async def all_there() -> bool:
        return all(rid in servers() for rid in ids.values())

    await until(all_there, 15, "a server span per request")
    found = servers()
    traces = {found[ids[path]].trace_id for path, _, _ in calls}
    assert len(traces) == len(calls)  # no client context: a new trace each
    for path, _, operation in calls:
        server = found[ids[path]]
        assert server.name == f"POST {path}" and server.parent_id == ""
        assert server.attributes["gen_ai.operation.name"] == operation, path
        spans = receiver.received.trace(server.trace_id)
        attempts = [sp for sp in spans if sp.kind == "CLIENT"]
        assert [sp.name for sp in attempts] == [f"{operation} sim-model"], path
        assert attempts[0].parent_id == server.span_id
        if operation != "embeddings":
            assert server.attributes["gen_ai.usage.output_tokens"] > 0, path
            assert server.attributes["gen_ai.response.finish_reasons"], path


async def _secret_request(url: str) -> tuple[str, str, str]:
    """A streamed chat whose prompt holds SECRET_WORD: (trace id, request id, answer text)."""
    trace_id, _, traceparent = client_traceparent()
    r = await post_stream(
        url + "/v1/chat/completions",
        {
            "model": "sim-model",
            "stream": True,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": f"my word is {SECRET_WORD} keep it"}],
        },
        headers={**AUTH, "traceparent": traceparent},
    )
    assert r.status == 200 and len(r.text.split()) == 8, r.body
    return trace_id, request_id_of(r.headers), r.text


async def test_no_prompt_or_completion_text_and_no_key_in_any_span_by_default(
    traced: procs.Service, receiver: Receiver
) -> None:
    trace_id, _, answer = await _secret_request(traced.url)
    spans = await exported(receiver, trace_id)
    assert len(spans) == 5
    exported_bytes = b"".join(receiver.received.raw)
    assert SECRET_WORD.encode() not in exported_bytes
    assert answer.strip().encode() not in exported_bytes
    assert CLIENT_KEY.encode() not in exported_bytes
    assert UPSTREAM_KEY.encode() not in exported_bytes
    assert b"Bearer" not in exported_bytes
    for s in spans:
        assert not any(k.startswith(("gen_ai.input", "gen_ai.output")) for k in s.attributes)


async def test_with_capture_content_the_text_is_in_the_span_but_never_a_key(
    sim: procs.Service, tmp_path: Path
) -> None:
    cfg = _config(tmp_path, sim, "capture", capture=True)
    with (
        Receiver() as receiver,
        procs.gateway("--config", cfg, env={**receiver.env(), KEY_ENV: UPSTREAM_KEY}) as gw,
    ):
        trace_id, _, answer = await _secret_request(gw.url)
        spans = await exported(receiver, trace_id)
        exported_bytes = b"".join(receiver.received.raw)
    server = next(s for s in spans if s.kind == "SERVER")
    assert SECRET_WORD in server.attributes["gen_ai.input.messages"]
    assert answer in server.attributes["gen_ai.output.messages"]
    assert CLIENT_KEY.encode() not in exported_bytes
    assert UPSTREAM_KEY.encode() not in exported_bytes


async def test_tracing_off_exports_nothing_and_sends_no_traceparent_upstream(
    sim: procs.Service, tmp_path: Path
) -> None:
    cfg = _config(tmp_path, sim, "off")
    with Receiver() as receiver:
        # No endpoint at all; and an endpoint with the SDK disabled.
        for env in ({}, {**receiver.env(), "OTEL_SDK_DISABLED": "true"}):
            with procs.gateway("--config", cfg, env={**env, KEY_ENV: UPSTREAM_KEY}) as gw:
                _, rid, _ = await _secret_request(gw.url)
                assert "OpenTelemetry" not in gw.output()
            records = [x for x in await sim_records(sim) if x["id"] == rid]
            assert [x["traceparent"] for x in records] == [None]
        # The gateways have stopped (and would have flushed): nothing ever arrived.
        assert receiver.received.requests == 0


async def test_the_genai_metrics_go_out_over_otlp_when_a_metrics_endpoint_is_set(
    sim: procs.Service, tmp_path: Path
) -> None:
    cfg = _config(tmp_path, sim, "metrics")
    with Receiver() as receiver:
        env = {
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": receiver.http_url + "/v1/metrics",
            "OTEL_METRIC_EXPORT_INTERVAL": "200",
            KEY_ENV: UPSTREAM_KEY,
        }
        with procs.gateway("--config", cfg, env=env) as gw:
            sent = [await _secret_request(gw.url) for _ in range(3)]
            # Without a client's traceparent: none goes upstream.
            r = await post_stream(
                gw.url + "/v1/chat/completions",
                {
                    "model": "sim-model",
                    "stream": True,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}],
                },
                headers=AUTH,
            )
            assert r.status == 200 and r.done, r.body
            bare = request_id_of(r.headers)
            # One that fails before any upstream answers: counted too, with its error.
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    gw.url + "/v1/chat/completions",
                    json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
                    headers=AUTH,
                ) as resp,
            ):
                assert resp.status == 404

            async def recorded() -> bool:
                m = receiver.received.metrics
                return sum(p["_count"] for p in m.get("gen_ai.server.request.duration", ())) >= 5

            await until(recorded, 15, "gen_ai.server.request.duration of 5 requests")
        m = dict(receiver.received.metrics)
    assert not receiver.received.spans  # a metrics endpoint alone: no traces
    # Nothing traced, the client's trace context goes on upstream unchanged (its own span
    # as the parent, its sampled flag); a request without one sends none.
    records = {x["id"]: x["traceparent"] for x in await sim_records(sim)}
    for trace_id, rid, _ in sent:
        assert records[rid] is not None and records[rid].startswith(f"00-{trace_id}-")
        assert records[rid].endswith("-01")
    assert records[bare] is None
    for name in (
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
        "gen_ai.client.token.usage",
        "gen_ai.server.request.duration",
    ):
        ok = [p for p in m.get(name, ()) if "error.type" not in p]
        assert ok, (name, sorted(m))
        point = ok[-1]
        assert point["gen_ai.operation.name"] == "chat"
        assert point["gen_ai.provider.name"] == "openai"
        assert point["gen_ai.request.model"] == "sim-model"
    kinds = {p["gen_ai.token.type"] for p in m["gen_ai.client.token.usage"]}
    assert kinds == {"input", "output"}
    failed = {
        (p["error.type"], p["gen_ai.request.model"])
        for p in m["gen_ai.server.request.duration"]
        if "error.type" in p
    }
    assert failed == {("404", "other")}  # (a model no upstream serves: bounded to `other`)


async def test_an_otel_setting_the_sdk_refuses_leaves_the_gateway_serving_untraced(
    sim: procs.Service, tmp_path: Path
) -> None:
    # OTEL_BSP_MAX_QUEUE_SIZE=-5 made the batch processor raise through start-up: no gateway.
    cfg = _config(tmp_path, sim, "refused")
    with Receiver() as receiver:
        env = {**receiver.env(), "OTEL_BSP_MAX_QUEUE_SIZE": "-5", KEY_ENV: UPSTREAM_KEY}
        with procs.gateway("--config", cfg, env=env) as gw:
            _, rid, _ = await _secret_request(gw.url)
            assert "OpenTelemetry is off: max_queue_size must be a positive integer" in gw.output()
        records = [x for x in await sim_records(sim) if x["id"] == rid]
        assert [x["traceparent"] for x in records] == [None]
        assert receiver.received.requests == 0
