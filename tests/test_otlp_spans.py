"""Spans written as OTLP bytes by hand (observe/otlp_spans.py) are the exporters' bytes: the
same request, byte for byte, as `encode_spans(...).SerializePartialToString()` on real SDK
spans of every shape the gateway makes and some it does not."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.span import TraceFlags, TraceState

from tokenpipe.observe import otlp_spans


def _provider(resource: dict[str, object]) -> tuple[TracerProvider, InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(resource))  # type: ignore[arg-type]
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider, memory


@pytest.fixture
def spans() -> Iterator[list[ReadableSpan]]:
    """A request's spans as the gateway makes them, and odder ones, over two resources and
    three scopes, interleaved."""
    first, memory1 = _provider({"service.name": "tokenpipe", "service.version": "0.1"})
    second, memory2 = _provider({"service.name": "other", "weight": 2.5, "tags": ("a", "b")})
    gateway = first.get_tracer("tokenpipe", "0.1.0")
    bare = first.get_tracer("bare")  # no version
    other = second.get_tracer("other", "9", schema_url="https://opentelemetry.io/schemas/1.21.0")
    remote = SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "v1"), ("rojo", "00f067aa0ba902b7")]),
    )
    parent = trace.set_span_in_context(NonRecordingSpan(remote))
    server_attributes = {
        "http.request.method": "POST",
        "url.path": "/v1/chat/completions",
        "gen_ai.request.model": "gemma-3-270m",
        "gen_ai.request.max_tokens": 64,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.response.finish_reasons": ("stop", "length"),
        "tokenpipe.stream": True,
        "tokenpipe.hedged": False,
        "zero": 0,
        "negative": -5,
        "big": (1 << 63) - 1,
        "smallest": -(1 << 63),
        "empty": "",
        "unicode": "héllo ✓ 🚀",
        "long": "x" * 300,
        "ints": (1, 2, 300),
        "floats": (0.5, -1e300),
        "bools": (True, False),
        "": "empty key",
    }
    with gateway.start_as_current_span(
        "chat gemma", context=parent, kind=SpanKind.SERVER, attributes=server_attributes
    ) as server:
        server.add_event("first_token", {"tokenpipe.ttft_ms": 12.5})
        server.add_event("bare")
        with gateway.start_as_current_span("admission"):
            pass
        with gateway.start_as_current_span("limiter wait") as wait:
            wait.set_status(Status(StatusCode.ERROR, "no capacity"))
        with other.start_as_current_span("elsewhere", kind=SpanKind.CONSUMER):
            pass
        with gateway.start_as_current_span("chat gemma", kind=SpanKind.CLIENT) as attempt:
            attempt.set_attribute("http.response.status_code", 200)
            attempt.set_status(Status(StatusCode.OK))
        with bare.start_as_current_span("", kind=SpanKind.PRODUCER):
            pass
        with gateway.start_as_current_span("errored") as errored:
            errored.set_status(Status(StatusCode.ERROR))
    token = otel_context.attach(otel_context.Context())  # a root span: no parent
    try:
        with gateway.start_as_current_span("root"):
            pass
    finally:
        otel_context.detach(token)
    yield [*memory1.get_finished_spans(), *memory2.get_finished_spans()]
    first.shutdown()
    second.shutdown()


def test_the_bytes_are_the_exporters_bytes(spans: list[ReadableSpan]) -> None:
    ours = otlp_spans.encode(spans)
    theirs = encode_spans(spans).SerializePartialToString()
    assert ours == theirs
    assert len(ExportTraceServiceRequest.FromString(ours).resource_spans) == 2


def test_every_order_and_subset_of_a_batch_too(spans: list[ReadableSpan]) -> None:
    """Groups by resource and scope in the order each first appears, as theirs does."""
    for batch in (spans[::-1], spans[1::2], spans[:1], spans[3:] + spans[:3], []):
        assert otlp_spans.encode(batch) == encode_spans(batch).SerializePartialToString()


@pytest.mark.parametrize(
    ("value", "error"),
    [(1 << 64, otlp_spans.Unsupported), ("lone \ud800 surrogate", UnicodeEncodeError)],
)
def test_what_it_does_not_write_goes_the_exporters_way(
    value: object, error: type[Exception]
) -> None:
    """Their encoder logs and drops such a value (no int64; no UTF-8), the span kept."""
    provider, memory = _provider({"service.name": "tokenpipe"})
    with provider.get_tracer("t").start_as_current_span("s") as span:
        span.set_attribute("odd", value)  # type: ignore[arg-type]
        span.set_attribute("fine", 1)
    batch = memory.get_finished_spans()
    with pytest.raises(error):
        otlp_spans.encode(batch)
    theirs = encode_spans(batch)
    assert otlp_spans.request(batch) == theirs
    assert otlp_spans.message(batch) == theirs
    assert [kv.key for kv in theirs.resource_spans[0].scope_spans[0].spans[0].attributes] == [
        "fine"
    ]
    provider.shutdown()


def test_the_grpc_message_is_the_exporters_message(spans: list[ReadableSpan]) -> None:
    assert otlp_spans.message(spans) == encode_spans(spans)
    assert otlp_spans.request(spans).SerializePartialToString() == otlp_spans.encode(spans)


def test_the_keys_kept_are_bounded(spans: list[ReadableSpan]) -> None:
    otlp_spans._keys.clear()
    for i in range(otlp_spans.KEYS_MAX + 10):
        otlp_spans._key(f"k{i}")
    assert len(otlp_spans._keys) <= otlp_spans.KEYS_MAX
    assert otlp_spans.encode(spans) == encode_spans(spans).SerializePartialToString()
