"""Observability: the Prometheus metrics (`metrics`, with bounded label values), structured
logs carrying the request id (`logs`), event-loop runtime samples (`runtime`), and
OpenTelemetry: its set-up from the OTEL_* environment (`otel`), one request's spans
(`tracing`, `spans`) and the GenAI metrics exported over OTLP (`genai`).

Layer: below the request path, imported by every layer; imports nothing of tokenpipe
outside this package.
"""
