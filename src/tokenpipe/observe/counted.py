"""A request's trace when only the GenAI metrics are on (a metrics endpoint, no traces one):
what the metrics need of it (the operation, the model asked for and the one that answered,
the provider, the end) and nothing else. No span is made and no attribute set.

As OpenTelemetry's no-op tracer did here before: a client's `traceparent` (and
`tracestate`) goes on to the upstream unchanged, and a request without one sends none. Its
context is read only when the header is there: reading it for every request, with the span
and context objects the no-op tracer made of it, and the SDK's records, had cost a 1-token
request 426k machine instructions, more than half of its path
(benchmarks/request_instructions.py --otlp metrics).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace as otel

from tokenpipe.observe import tracing
from tokenpipe.observe.spans import NO_SPAN, NoSpan, header_lines


class CountedTrace(tracing.RequestTrace):
    """The trace of `carrier`'s request (its headers or gRPC metadata), counted only."""

    __slots__ = ()

    def __init__(self, carrier: Mapping[str, str]) -> None:
        self.recording = False
        self.capture = False
        self._unsampled = NO_SPAN
        if "traceparent" in carrier:  # (a case-insensitive mapping, or gRPC's lower-case keys)
            parent = otel.get_current_span(tracing.PROPAGATOR.extract(carrier))
            self._unsampled = NoSpan(header_lines(parent.get_span_context()))
        self._begin()

    def set(self, key: str, value: Any) -> None:
        pass

    def request(self, api: str, model: str, stream: bool, obj: Mapping[str, Any]) -> None:
        self.operation = tracing.OPERATIONS.get(api, api)
        self.model = model

    def close(self, status: int, http: bool = True) -> None:
        self._settle(status)
