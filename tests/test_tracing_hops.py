"""The spans of each hop, exported over OTLP/gRPC to a real receiver: a hedged request shows
both attempts and which won (and each upstream got its own attempt's traceparent), a retry
shows the failed first send, the context hop's summary call is a CLIENT span of its own, and
the gRPC front opens a server span too. The hedged trace is drawn as a waterfall and
screenshotted (docs/observability.md shows that picture)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml

from tests import png, procs
from tests.otlp_receiver import Receiver, Span
from tests.polling import until
from tests.sse_client import post_stream
from tests.test_bench_html import CHROMIUM, render
from tests.test_context_gateway import conversation
from tests.test_tracing_spans import client_traceparent, exported, request_id_of, sim_records
from tests.trace_waterfall import COLORS
from tests.trace_waterfall import render as waterfall
from tokenpipe.front.grpc_gen import chat_pb2 as pb
from tokenpipe.front.grpc_gen import chat_pb2_grpc as pb_grpc

HEDGE_DELAY = 0.2  # seconds: the hedge goes out this long after the stalled first send
HI = {"role": "user", "content": "hi"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Hops:
    receiver: Receiver
    slow: procs.Service  # stalls every first token for 3 s
    broken: procs.Service  # answers every request 500
    stalling: procs.Service  # stops for 20 s after 5 tokens
    fast: procs.Service
    gw: procs.Service  # exporting over OTLP/gRPC
    grpc_target: str  # the gateway's gRPC front


@pytest.fixture(scope="module")
def hops(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hops]:
    with (
        Receiver() as receiver,
        procs.sim("--ttft-ms", "5", "--itl-ms", "1", "--fault", "stall-first:3000@1") as slow,
        procs.sim("--ttft-ms", "5", "--itl-ms", "1", "--fault", "status:500@1") as broken,
        procs.sim("--ttft-ms", "5", "--itl-ms", "1", "--fault", "stall:5:20000@1") as stalling,
        procs.sim("--ttft-ms", "5", "--itl-ms", "1") as fast,
    ):
        config = {
            "upstreams": [
                {"name": "slow", "url": slow.url + "/v1", "models": ["hedged"]},
                {"name": "broken", "url": broken.url + "/v1", "models": ["retried"]},
                {"name": "stalling", "url": stalling.url + "/v1", "models": ["continued"]},
                {
                    "name": "fast",
                    "url": fast.url + "/v1",
                    "models": [
                        "hedged",
                        "retried",
                        "continued",
                        "summarized",
                        "big-summarizer",
                        "sim-model",
                    ],
                },
            ],
            # Every stalled request of these tests may hedge (the default budget: 1 in 10).
            "tail": {
                "hedging": {"initial_delay_seconds": HEDGE_DELAY, "budget_reserve": 10},
                "stall": {"floor_seconds": 0.3, "initial_seconds": 0.3, "ceiling_seconds": 1},
            },
            "context": {
                "policy": "truncate",
                "margin_tokens": 8,
                "reserve_output_tokens": 64,
                "min_output_tokens": 16,
                "summary_max_tokens": 40,
                "summarizer_model": "big-summarizer",
                "models": [
                    {
                        "name": "summarized",
                        "window": 600,
                        "policy": "summarize",
                        "tokenizer": "tiktoken:cl100k_base",
                    },
                    {"name": "big-summarizer", "window": 100_000},
                ],
            },
        }
        path = tmp_path_factory.mktemp("hops") / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        port = _free_port()
        # The later --grpc-port wins over procs.gateway's own "0" (off).
        with procs.gateway(
            "--config", str(path), "--grpc-port", str(port), env=receiver.env("grpc")
        ) as gw:
            yield Hops(receiver, slow, broken, stalling, fast, gw, f"127.0.0.1:{port}")


def _attempts(spans: list[Span]) -> list[Span]:
    return sorted((s for s in spans if s.kind == "CLIENT"), key=lambda s: s.start)


async def _hedged(gw: procs.Service) -> tuple[str, str]:
    trace_id, _, traceparent = client_traceparent()
    r = await post_stream(
        gw.url + "/v1/chat/completions",
        {"model": "hedged", "stream": True, "max_tokens": 6, "messages": [HI]},
        headers={"traceparent": traceparent},
    )
    assert r.status == 200 and r.done and not r.errors, r.chunks
    return trace_id, request_id_of(r.headers)


async def test_a_hedged_request_shows_both_attempts_which_won_and_each_upstream_joined(
    hops: Hops,
) -> None:
    receiver = hops.receiver
    trace_id, rid = await _hedged(hops.gw)
    spans = await exported(receiver, trace_id)
    server = next(s for s in spans if s.kind == "SERVER")
    assert server.attributes["tokenpipe.hedge.outcome"] == "won"
    assert server.attributes["tokenpipe.attempts"] == 2
    assert server.attributes["tokenpipe.status"] == 200
    first, hedge = _attempts(spans)
    assert first.parent_id == hedge.parent_id == server.span_id
    a, b = first.attributes, hedge.attributes
    assert (a["tokenpipe.upstream.name"], a["tokenpipe.attempt.role"]) == ("slow", "first")
    assert a["tokenpipe.attempt.outcome"] == "lost" and first.status != 2  # lost, not failed
    assert (b["tokenpipe.upstream.name"], b["tokenpipe.attempt.role"]) == ("fast", "hedge")
    assert b["tokenpipe.attempt.outcome"] == "won"
    assert hedge.event("first_token") is not None and first.event("first_token") is None
    # The hedge went out after the hedge delay, while the first send still waited.
    assert hedge.start - first.start >= HEDGE_DELAY * 1e9 * 0.9
    assert first.end >= hedge.start
    assert len([s for s in spans if s.name == "limiter wait"]) == 2
    # Each upstream got the traceparent of its own attempt, in the client's trace.
    for sim, attempt in ((hops.slow, first), (hops.fast, hedge)):
        got = [x["traceparent"] for x in await sim_records(sim) if x["id"] == rid]
        assert got == [f"00-{trace_id}-{attempt.span_id}-01"], sim.url


async def test_a_retry_shows_the_failed_first_send_and_the_retry_that_answered(
    hops: Hops,
) -> None:
    receiver = hops.receiver
    trace_id, _, traceparent = client_traceparent()
    r = await post_stream(
        hops.gw.url + "/v1/chat/completions",
        {"model": "retried", "stream": True, "max_tokens": 4, "messages": [HI]},
        headers={"traceparent": traceparent},
    )
    assert r.status == 200 and r.done, r.body
    first, retry = _attempts(await exported(receiver, trace_id))
    a, b = first.attributes, retry.attributes
    assert (a["tokenpipe.upstream.name"], a["tokenpipe.attempt.role"]) == ("broken", "first")
    assert a["tokenpipe.attempt.outcome"] == "status_5xx" and a["http.response.status_code"] == 500
    assert first.status == 2 and a["error.type"] == "status_5xx"  # a failed span
    assert (b["tokenpipe.upstream.name"], b["tokenpipe.attempt.role"]) == ("fast", "retry")
    assert b["tokenpipe.attempt.outcome"] == "answered" and retry.status != 2


async def test_a_stream_that_stalls_mid_way_shows_the_stall_and_its_continuation(
    hops: Hops,
) -> None:
    trace_id, _, traceparent = client_traceparent()
    r = await post_stream(
        hops.gw.url + "/v1/completions",
        {"model": "continued", "stream": True, "max_tokens": 20, "prompt": "alpha beta gamma"},
        headers={"traceparent": traceparent},
    )
    assert r.status == 200 and r.done and not r.errors, r.chunks
    spans = await exported(hops.receiver, trace_id)
    first, continuation = _attempts(spans)
    a, b = first.attributes, continuation.attributes
    assert (a["tokenpipe.upstream.name"], a["tokenpipe.attempt.role"]) == ("stalling", "first")
    assert a["tokenpipe.attempt.outcome"] == "stalled" and first.status == 2
    stall = first.event("stall")
    assert stall is not None and "stall deadline of 0.3 s" in stall["tokenpipe.stall.bound"]
    assert (b["tokenpipe.upstream.name"], b["tokenpipe.attempt.role"]) == ("fast", "continuation")
    assert b["tokenpipe.attempt.outcome"] == "answered"
    # The continuation went out after the stall; the stalled one closed once it took over.
    stalled_at = dict(first.event_times)["stall"]
    assert stalled_at <= continuation.start <= first.end
    server = next(s for s in spans if s.kind == "SERVER")
    assert server.attributes["gen_ai.operation.name"] == "text_completion"
    assert server.attributes["tokenpipe.stream.deltas"] == 20


async def test_the_summary_call_is_a_client_span_of_its_own_under_the_context_span(
    hops: Hops,
) -> None:
    receiver = hops.receiver
    trace_id, _, traceparent = client_traceparent()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            hops.gw.url + "/v1/chat/completions",
            json={"model": "summarized", "max_tokens": 30, "messages": conversation(40, tag="tr")},
            headers={"traceparent": traceparent},
        ) as r,
    ):
        assert r.status == 200, await r.text()
        assert r.headers["x-tokenpipe-context"].endswith("summary=new")
    spans = await exported(receiver, trace_id)
    by_id = {s.span_id: s for s in spans}
    server = next(s for s in spans if s.kind == "SERVER")
    context = next(s for s in spans if s.name == "context")
    assert context.parent_id == server.span_id
    assert "summary=new" in context.attributes["tokenpipe.context.report"]
    summary = next(s for s in spans if s.name == "summarize big-summarizer")
    assert summary.kind == "CLIENT" and summary.parent_id == context.span_id
    assert summary.attributes["gen_ai.request.model"] == "big-summarizer"
    below = [s for s in spans if s.parent_id == summary.span_id]
    assert sorted(s.name for s in below) == ["chat big-summarizer", "limiter wait"]
    call = next(s for s in below if s.kind == "CLIENT")
    assert call.attributes["tokenpipe.upstream.name"] == "fast"
    assert context.start <= summary.start and summary.end <= context.end
    # The request itself went out after the context hop, under the server span.
    (answer,) = [s for s in _attempts(spans) if s.name == "chat summarized"]
    assert by_id[answer.parent_id] is server and answer.start >= context.end
    # The summary's upstream request joined the trace through the summary's attempt span.
    got = [
        x["traceparent"]
        for x in await sim_records(hops.fast)
        if x["id"].startswith("ctx-summary-") and trace_id in (x["traceparent"] or "")
    ]
    assert got == [f"00-{trace_id}-{call.span_id}-01"]


async def _grpc_messages(rid: str) -> AsyncIterator[pb.ClientMessage]:
    yield pb.ClientMessage(
        request=pb.ChatRequest(
            request_id=rid,
            model="sim-model",
            max_tokens=5,
            messages=[pb.Message(role="user", content="hello over grpc")],
        )
    )


async def test_a_grpc_request_gets_a_server_span_continuing_the_calls_traceparent(
    hops: Hops,
) -> None:
    receiver, target = hops.receiver, hops.grpc_target
    trace_id, client_span, traceparent = client_traceparent()
    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.ChatStub(channel).ChatStream(
            _grpc_messages("r1"), metadata=(("traceparent", traceparent),)
        )
        kinds = [m.WhichOneof("kind") async for m in call]
    assert kinds[-1] == "done", kinds
    spans = await exported(receiver, trace_id)
    server = next(s for s in spans if s.kind == "SERVER")
    assert server.name == "tokenpipe.v1.Chat/ChatStream" and server.parent_id == client_span
    assert server.attributes["rpc.system"] == "grpc"
    assert server.attributes["gen_ai.usage.output_tokens"] == 5
    (attempt,) = _attempts(spans)
    assert attempt.parent_id == server.span_id
    assert attempt.attributes["tokenpipe.attempt.outcome"] == "answered"


async def test_a_grpc_request_with_the_metrics_alone_is_counted_and_passes_its_traceparent_on(
    sim: procs.Service,
) -> None:
    # A metrics endpoint and no traces one: the gRPC front's request makes no span, counts in
    # the GenAI metrics, and its metadata's traceparent reaches the upstream unchanged.
    trace_id, client_span, traceparent = client_traceparent()
    port = _free_port()
    with Receiver() as receiver:
        env = {
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": receiver.http_url + "/v1/metrics",
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
            "OTEL_METRIC_EXPORT_INTERVAL": "200",
        }
        with procs.gateway("--upstream", sim.url + "/v1", "--grpc-port", str(port), env=env) as gw:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = pb_grpc.ChatStub(channel).ChatStream(
                    _grpc_messages("m1"), metadata=(("traceparent", traceparent),)
                )
                kinds = [m.WhichOneof("kind") async for m in call]
            assert kinds[-1] == "done", kinds

            async def counted() -> bool:
                points = receiver.received.metrics.get("gen_ai.server.request.duration", ())
                return any(p["_count"] >= 1 for p in points)

            await until(counted, 15, "the gRPC request in gen_ai.server.request.duration")
            assert "OpenTelemetry: traces off" in gw.output()
    assert not receiver.received.spans
    sent = [x["traceparent"] for x in await sim_records(sim) if x["traceparent"]]
    assert f"00-{trace_id}-{client_span}-01" in sent


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make setup installs it)")
async def test_a_hedged_trace_drawn_as_a_waterfall_shows_the_winner_and_the_loser(
    hops: Hops,
) -> None:
    receiver = hops.receiver
    trace_id, _ = await _hedged(hops.gw)
    spans = await exported(receiver, trace_id)
    page, boxes, size = waterfall(spans, "A hedged request: the first send stalled, the hedge won")
    out = Path(__file__).parent.parent / ".cache" / "test-reports"
    out.mkdir(parents=True, exist_ok=True)
    (out / "trace-hedged.html").write_text(page)
    shot = out / "trace-hedged.png"
    _, console = render(out / "trace-hedged.html", shot, size)
    assert console == "", console
    img = png.read(shot.read_bytes())
    first, hedge = _attempts(spans)
    for span, color in ((first, COLORS["lost"]), (hedge, COLORS["won"])):
        x, y, w, h = boxes[span.span_id]
        seen = img.count(color, (x, y, w, h), tolerance=8)
        assert seen >= 0.8 * w * h, (span.name, color, seen, w * h)
    server = next(s for s in spans if s.kind == "SERVER")
    x, y, w, h = boxes[server.span_id]
    assert img.count(COLORS["SERVER"], (x, y, w, h), tolerance=8) >= 0.8 * w * h
