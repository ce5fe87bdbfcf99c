"""OpenTelemetry spans of one request (docs/observability.md, "Traces").

Off unless an OTLP endpoint is set (observe/otel.py reads the standard OTEL_* variables): then
`TRACER` is None, the fronts open no server span, every request's trace is `OFF` and every
span `NO_SPAN`, whose methods do nothing: no span, context or attribute dict is made, and a
request costs what it did before tracing existed (benchmarks/relay_cost.py --tracing off).

On, a request is one `RequestTrace`: its SERVER span, continuing the client's W3C
`traceparent`/`tracestate`, is the parent of `admission`, `context` (with the summary call as
a CLIENT span of its own), one `limiter wait` per send and one CLIENT span per upstream
attempt (first, retry, hedge, continuation), whose context the upstream gets as its
`traceparent`. Attributes follow the GenAI semantic conventions (`gen_ai.*`) plus tokenpipe's
own (`tokenpipe.*`). Prompt and completion text are recorded only with
`tracing.capture_content` (a privacy choice, off by default); keys and headers never.

A request the sampler leaves out still propagates its context upstream (flags 00) and still
counts in the GenAI metrics, but records no span below its server span.
"""

from __future__ import annotations

import contextvars
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from opentelemetry import trace as otel
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tokenpipe import answer_fields
from tokenpipe.observe.genai import GenAIMetrics
from tokenpipe.observe.spans import NO_SPAN, NoSpan, Span, header_lines, server_of

__all__ = ["NO_SPAN", "OFF", "NoSpan", "RequestTrace", "Span", "serve"]

#: The tracer, set by observe.otel.setup; None: tracing and the GenAI metrics are off. With
#: only a metrics endpoint it is OpenTelemetry's no-op tracer (requests count, nothing traced).
TRACER: otel.Tracer | None = None
#: The GenAI metrics (observe/genai.py); None without a metrics endpoint.
METRICS: GenAIMetrics | None = None
#: `tracing.capture_content`: prompt and completion text go into spans (off: never).
CAPTURE = False
#: Characters of captured text per attribute; longer text is cut (and says so).
MAX_CONTENT = 16 * 1024

PROPAGATOR = TraceContextTextMapPropagator()
#: The trace a request gets when only the GenAI metrics are on (observe/counted.py, set by
#: observe/otel.py); None: a span a request (TRACER's).
COUNTED: Callable[[Mapping[str, str]], RequestTrace] | None = None
#: `gen_ai.operation.name` by the client's API (the dialect's name).
OPERATIONS = {
    "chat": "chat",
    "messages": "chat",
    "responses": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    "count_tokens": "count_tokens",
}
#: The model an upstream names in its event or body (read once per stream, when traced).
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
#: Largest non-streamed answer parsed whole to capture its content (bytes).
CAPTURE_MAX_BYTES = 4 * 1024 * 1024
#: Finish reasons kept per request (one per choice; bounded for a request with many).
_MAX_REASONS = 16
#: Characters of one finish reason kept: an upstream sent 1 MB as one (10 MB a batch of
#: spans, which a collector with a size cap refuses whole, every other request's spans in it).
_MAX_REASON_CHARS = 64


def _text(value: Any) -> str:
    """Captured content as an attribute value: JSON, at most MAX_CONTENT characters."""
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    if len(text) > MAX_CONTENT:
        return text[:MAX_CONTENT] + f"... [cut at {MAX_CONTENT} characters]"
    return text


class RequestTrace:
    """One request's telemetry: its server span (the parent of every span below), what the
    GenAI attributes and metrics need, and `capture` (content goes into spans)."""

    __slots__ = (
        "_ctx",
        "_unsampled",
        "attempts",
        "capture",
        "finish_reasons",
        "finished",
        "model",
        "operation",
        "provider",
        "recording",
        "response_model",
        "span",
        "started",
        "waited",
    )
    on = True

    def __init__(self, span: otel.Span, capture: bool = False) -> None:
        self.span = span
        self.recording = span.is_recording()
        self._ctx = otel.set_span_in_context(span)
        self._unsampled = NoSpan(header_lines(span.get_span_context()))
        self.capture = capture and self.recording
        self._begin()

    def _begin(self) -> None:
        """What the request's end reports (its span's attributes, the GenAI metrics)."""
        self.operation = "chat"
        self.model = ""
        self.provider = ""
        self.response_model: str | None = None
        self.finish_reasons: list[str] = []
        self.attempts = 0
        self.waited = 0.0  # seconds in limiter queues, all sends
        self.started = time.perf_counter()
        self.finished = False  # `finish` ran (an upstream call was answered)

    def _start(self, name: str, kind: SpanKind, attributes: dict[str, Any] | None) -> Span:
        if not self.recording or TRACER is None:
            return self._unsampled
        now = time.time_ns()
        return Span(TRACER.start_span(name, self._ctx, kind, attributes, start_time=now), now)

    def set(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def step(self, name: str) -> Span:
        """A child span for one step of the request (`with trace.step(...) as span:`)."""
        return self._start(name, SpanKind.INTERNAL, None)

    def under(self, span: Span, model: str | None = None) -> RequestTrace:
        """The trace of what happens inside `span` (context budgeting, its summary call with
        the summarizer's `model`)."""
        if not span.on:
            return self
        sub = RequestTrace(span.otel)
        sub.operation, sub.model = self.operation, model or self.model
        return sub

    def summary(self, model: str) -> Span:
        """The context hop's summary call: a CLIENT span of its own (its attempts below it)."""
        return self._start(
            f"summarize {model}",
            SpanKind.CLIENT,
            {"gen_ai.operation.name": "chat", "gen_ai.request.model": model},
        )

    def request(self, api: str, model: str, stream: bool, obj: Mapping[str, Any]) -> None:
        """What the client asked for (the request as it arrived)."""
        self.operation = OPERATIONS.get(api, api)
        self.model = model
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.request.model": model,
            "tokenpipe.stream": stream,
        }
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = obj.get(field)
            if isinstance(value, int) and not isinstance(value, bool):
                attrs["gen_ai.request.max_tokens"] = value
                break
        temperature = obj.get("temperature")
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
            attrs["gen_ai.request.temperature"] = float(temperature)
        if self.capture:
            for field in ("messages", "input", "prompt"):
                if obj.get(field) is not None:
                    attrs["gen_ai.input.messages"] = _text(obj[field])
                    break
            for field in ("system", "instructions"):
                if obj.get(field) is not None:
                    attrs["gen_ai.system_instructions"] = _text(obj[field])
                    break
        self.span.set_attributes(attrs)

    def queue(self, upstream: str) -> Span:
        """The wait for the upstream's limiter capacity, before a send."""
        return self._start("limiter wait", SpanKind.INTERNAL, {"tokenpipe.upstream.name": upstream})

    def attempt(self, queued: Span, role: str, upstream: str, provider: str, url: str) -> Span:
        """Ends the limiter wait `queued` and opens the CLIENT span of one send upstream.
        `role`: first, retry, hedge or continuation."""
        self.attempts += 1
        self.provider = provider
        if not queued.on:
            return queued  # unsampled: the server span's context goes upstream
        queued.end()
        wait = (time.time_ns() - queued.started) / 1e9
        self.waited += wait
        address, port = server_of(url)
        return self._start(
            f"{self.operation} {self.model}",
            SpanKind.CLIENT,
            {
                "gen_ai.operation.name": self.operation,
                "gen_ai.provider.name": provider,
                "gen_ai.request.model": self.model,
                "server.address": address,
                "server.port": port,
                "tokenpipe.upstream.name": upstream,
                "tokenpipe.attempt.role": role,
                "tokenpipe.attempt.number": self.attempts,
                "tokenpipe.limiter.wait_seconds": wait,
            },
        )

    def first_token(self, ttft: float) -> None:
        """The client got its first content token, `ttft` seconds after arrival."""
        if self.recording:
            self.span.add_event("first_token", {"gen_ai.server.time_to_first_token": ttft})

    def saw(self, raw: bytes | None, finish_reason: str | None) -> None:
        """An event with usage, a finish or the end (a few per stream): its finish reason and
        the model the upstream names."""
        if finish_reason and len(self.finish_reasons) < _MAX_REASONS:
            self.finish_reasons.append(finish_reason[:_MAX_REASON_CHARS])
        if self.response_model is None and raw:
            m = _MODEL.search(raw)
            if m:
                self.response_model = m.group(1).decode("utf-8", "replace")

    def answer(self, status: int, fields: answer_fields.Fields | None, body: bytes) -> None:
        """A non-streamed answer (`fields`: what is read of `body`, answer_fields): its model,
        finish reasons and (captured) content. `body` is parsed whole only to capture
        content, up to CAPTURE_MAX_BYTES (the attribute keeps 16 KiB of it)."""
        if status != 200 or fields is None:
            return
        model = answer_fields.string(fields.model)
        if model is not None:
            self.response_model = model[:256]
        for reason in answer_fields.finish_reasons(fields)[:_MAX_REASONS]:
            if reason is not None:
                self.finish_reasons.append(reason[:_MAX_REASON_CHARS])
        for raw in (fields.stop_reason, fields.status):  # Anthropic's, the Responses API's
            value = answer_fields.string(raw)
            if value is not None and len(self.finish_reasons) < _MAX_REASONS:
                self.finish_reasons.append(value[:_MAX_REASON_CHARS])
                break
        if self.capture and len(body) <= CAPTURE_MAX_BYTES:
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError:
                return
            for field in ("choices", "content", "output"):
                if isinstance(obj, dict) and obj.get(field) is not None:
                    self.span.set_attribute("gen_ai.output.messages", _text(obj[field]))
                    break

    def output(self, text: str) -> None:
        """A stream's content (captured only), as the conventions' output message."""
        if self.capture and text:
            text = _text(text)
            message = [{"role": "assistant", "parts": [{"type": "text", "content": text}]}]
            self.span.set_attribute("gen_ai.output.messages", orjson.dumps(message).decode())

    def finish(
        self,
        status: int,
        duration: float,
        ttft: float | None,
        tpot: float | None,
        usage: dict[str, Any] | None,
        events: int,
        deltas: int,
    ) -> None:
        """The request ended with `status` (as recorded: 499 when the client went away)."""
        self.finished = True
        if self.recording:
            attrs: dict[str, Any] = {
                "tokenpipe.status": status,
                "tokenpipe.attempts": self.attempts,
                "tokenpipe.limiter.wait_seconds": self.waited,
            }
            if self.provider:
                attrs["gen_ai.provider.name"] = self.provider
            if self.response_model:
                attrs["gen_ai.response.model"] = self.response_model
            if self.finish_reasons:
                attrs["gen_ai.response.finish_reasons"] = tuple(self.finish_reasons)
            if ttft is not None:
                attrs["gen_ai.server.time_to_first_token"] = ttft
            if tpot is not None:
                attrs["gen_ai.server.time_per_output_token"] = tpot
            output = None
            if usage:
                for key, field in (("input", "prompt_tokens"), ("output", "completion_tokens")):
                    n = usage.get(field)
                    if isinstance(n, int):
                        attrs[f"gen_ai.usage.{key}_tokens"] = n
                output = usage.get("completion_tokens")
            if events:
                attrs["tokenpipe.stream.events"] = events
                attrs["tokenpipe.stream.deltas"] = deltas
                attrs["tokenpipe.stream.merged_deltas"] = deltas - events
                if isinstance(output, int):
                    attrs["tokenpipe.stream.tokens_per_event"] = output / events
            self.span.set_attributes(attrs)
            if status >= 500:
                self.span.set_status(Status(StatusCode.ERROR))
                self.span.set_attribute("error.type", str(status))
        if METRICS is not None:
            METRICS.record(
                operation=self.operation,
                provider=self.provider,
                model=self.model,
                response_model=self.response_model,
                status=status,
                duration=duration,
                ttft=ttft,
                tpot=tpot,
                usage=usage,
            )

    def close(self, status: int, http: bool = True) -> None:
        """Ends the server span with the status the client got (the front's)."""
        self._settle(status)
        if http:
            self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()

    def _settle(self, status: int) -> None:
        """A request that failed before an upstream answered (a quota's 429, no upstream
        left) is finished here: it counts in the metrics too, its status the `error.type`."""
        if not self.finished and self.model:
            self.finish(status, time.perf_counter() - self.started, None, None, None, 0, 0)


class NoTrace(RequestTrace):
    """The trace of a request when tracing is off: nothing is made, nothing recorded."""

    __slots__ = ()
    on = False

    def __init__(self) -> None:
        self.capture = False
        self.recording = False

    def set(self, key: str, value: Any) -> None:
        pass

    def step(self, name: str) -> Span:
        return NO_SPAN

    def under(self, span: Span, model: str | None = None) -> RequestTrace:
        return self

    def summary(self, model: str) -> Span:
        return NO_SPAN

    def request(self, api: str, model: str, stream: bool, obj: Mapping[str, Any]) -> None:
        pass

    def queue(self, upstream: str) -> Span:
        return NO_SPAN

    def attempt(self, queued: Span, role: str, upstream: str, provider: str, url: str) -> Span:
        return NO_SPAN

    def first_token(self, ttft: float) -> None:
        pass

    def saw(self, raw: bytes | None, finish_reason: str | None) -> None:
        pass

    def answer(self, status: int, fields: answer_fields.Fields | None, body: bytes) -> None:
        pass

    def output(self, text: str) -> None:
        pass

    def finish(
        self,
        status: int,
        duration: float,
        ttft: float | None,
        tpot: float | None,
        usage: dict[str, Any] | None,
        events: int,
        deltas: int,
    ) -> None:
        pass

    def close(self, status: int, http: bool = True) -> None:
        pass


OFF = NoTrace()
#: The trace of the request being served, set by the front that opened its server span.
CURRENT: contextvars.ContextVar[RequestTrace] = contextvars.ContextVar(
    "tokenpipe_trace", default=OFF
)


def serve(
    carrier: Mapping[str, str], span: Callable[[], tuple[str, dict[str, Any]]]
) -> RequestTrace:
    """Opens a request's SERVER span, continuing the W3C trace context in `carrier` (the
    request's headers or gRPC metadata); `span()` gives its name and attributes, asked only
    when a span is made. Only when TRACER is set; with the GenAI metrics alone, the trace
    that only counts (COUNTED)."""
    if COUNTED is not None:
        return COUNTED(carrier)
    assert TRACER is not None
    name, attributes = span()
    parent = PROPAGATOR.extract(carrier)
    return RequestTrace(TRACER.start_span(name, parent, SpanKind.SERVER, attributes), CAPTURE)
