"""Sets up the OpenTelemetry SDK from the standard environment variables, once per gateway
process (`gateway.run`; each `serve --workers` process has its own), and flushes it at exit.

Traces go out when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is
set; the GenAI metrics when `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` is set, or the general
endpoint with `OTEL_METRICS_EXPORTER=otlp` (Prometheus is the gateway's own metrics; OTLP
metrics are asked for). `OTEL_EXPORTER_OTLP_PROTOCOL` (or the per-signal variable) picks
`http/protobuf` (the default) or `grpc`; `OTEL_SERVICE_NAME` names the service (default
`tokenpipe`); `OTEL_TRACES_SAMPLER`/`_ARG` sample (default `parentbased_always_on`: a
client's sampled flag is followed); `OTEL_SDK_DISABLED=true` turns all of it off. The metric
export's interval, timeout and temporality are read by observe/genai_export.py as the SDK's
reader reads them; everything else (headers, TLS files, timeouts, compression, `OTEL_BSP_*`
batching) by the SDK and its exporters themselves. Nothing set: nothing is imported
or started, and the request path's hooks are no-ops (observe/tracing.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tokenpipe.observe import tracing
from tokenpipe.observe.genai import GenAIMetrics

log = logging.getLogger("tokenpipe.observe")

_PROTOCOLS = ("http/protobuf", "grpc")
#: The SDK providers of this process, shut down (flushed) by `shutdown`.
_providers: list[Any] = []


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def _protocol(signal: str) -> str:
    asked = _env(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
    asked = asked.lower() or "http/protobuf"
    if asked not in _PROTOCOLS:
        log.warning("OTLP protocol %r is not supported; using http/protobuf", asked)
        return "http/protobuf"
    return asked


def traces_endpoint() -> str:
    """Where traces go ('' when they are off)."""
    if _env("OTEL_TRACES_EXPORTER").lower() == "none":
        return ""
    return _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_ENDPOINT")


def metrics_endpoint() -> str:
    """Where the GenAI metrics go ('' when they are off)."""
    exporter = _env("OTEL_METRICS_EXPORTER").lower()
    if exporter == "none":
        return ""
    general = _env("OTEL_EXPORTER_OTLP_ENDPOINT") if exporter == "otlp" else ""
    return _env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or general


def _resource() -> Any:
    from opentelemetry.sdk.resources import Resource

    from tokenpipe import __version__

    attrs = {"service.version": __version__}
    if not _env("OTEL_SERVICE_NAME") and "service.name=" not in _env("OTEL_RESOURCE_ATTRIBUTES"):
        attrs["service.name"] = "tokenpipe"
    return Resource.create(attrs)  # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES merged in


def _span_exporter() -> Any:
    """The OTLP span exporter of the protocol asked for, its batches encoded by
    `otlp_spans` (its module doc: the exporters' encoder was ~30% of a traced gateway's
    CPU). gRPC: through the exporter's own hook for it (`_translate_data`). HTTP: it has
    none; its module's `encode_spans`, which its `export` calls, is replaced (where the
    module has one: else it keeps its own)."""
    from tokenpipe.observe import otlp_spans

    if _protocol("TRACES") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        class GrpcSpanExporter(OTLPSpanExporter):
            def _translate_data(self, data: Any) -> Any:
                return otlp_spans.message(data)

        return GrpcSpanExporter()
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    if hasattr(trace_exporter, "encode_spans"):
        trace_exporter.encode_spans = otlp_spans.request  # type: ignore[assignment]
    return trace_exporter.OTLPSpanExporter()


def _metric_exporter() -> Any:
    if _protocol("METRICS") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetricExporter,
    )

    return HttpMetricExporter()


def setup(capture_content: bool = False) -> bool:
    """Starts tracing and the GenAI metrics as the environment says; True when either is on.
    `capture_content`: `tracing.capture_content` of the config (prompt and completion text
    in spans)."""
    if _env("OTEL_SDK_DISABLED").lower() == "true":
        return False
    traces_to, metrics_to = traces_endpoint(), metrics_endpoint()
    if not traces_to and not metrics_to:
        return False
    try:
        _start(traces_to, metrics_to)
    except ValueError as e:
        # An OTEL_* value the SDK refuses (OTEL_BSP_MAX_QUEUE_SIZE=-5 raised through start-up).
        # Telemetry is not worth the traffic: as the OpenTelemetry spec asks of bad settings,
        # the gateway says so and runs without it.
        shutdown()
        log.error("OpenTelemetry is off: %s (an OTEL_* environment variable)", e)
        return False
    tracing.CAPTURE = capture_content
    log.info(
        "OpenTelemetry: traces %s, GenAI metrics %s%s",
        f"to {traces_to} ({_protocol('TRACES')})" if traces_to else "off",
        f"to {metrics_to} ({_protocol('METRICS')})" if metrics_to else "off",
        "; prompt and completion text captured" if capture_content else "",
    )
    return True


def _start(traces_to: str, metrics_to: str) -> None:
    from tokenpipe import __version__

    resource = _resource()
    if traces_to:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # The sampler comes from OTEL_TRACES_SAMPLER(_ARG); the batch processor's bounded
        # queue (OTEL_BSP_MAX_QUEUE_SIZE, 2048) drops spans rather than grow when the
        # collector is slow or away, and exports from its own thread.
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(_span_exporter()))
        _providers.append(provider)
        tracing.TRACER = provider.get_tracer("tokenpipe", __version__)
    else:
        from opentelemetry.trace import NoOpTracer

        from tokenpipe.observe.counted import CountedTrace

        tracing.TRACER = NoOpTracer()  # metrics only: requests count, nothing is traced
        tracing.COUNTED = CountedTrace
    if metrics_to:
        from tokenpipe.observe.genai_export import Export

        # Aggregated by tokenpipe, sent by the SDK's exporter (observe/genai.py says why).
        genai = GenAIMetrics()
        _providers.append(Export(genai, _metric_exporter(), resource, __version__))
        tracing.METRICS = genai


def shutdown() -> None:
    """Exports what is left (spans batched, the last metric interval) and stops."""
    tracing.TRACER = None
    tracing.COUNTED = None
    tracing.METRICS = None
    tracing.CAPTURE = False
    while _providers:
        provider = _providers.pop()
        try:
            provider.shutdown()
        except Exception:  # an exporter that cannot reach its collector must not fail exit
            log.warning("OpenTelemetry: flushing at shutdown failed", exc_info=True)
