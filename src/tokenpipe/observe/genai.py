"""The GenAI semantic conventions' metrics, exported over OTLP by the OpenTelemetry metrics SDK
when a metrics endpoint is set (observe/otel.py); Prometheus (observe/metrics.py) is unchanged.

One request records once, when it ends (`GenAIMetrics.record`): attribute values are bounded
as Prometheus labels are (a model name no upstream serves is `other`), so a client cannot grow
the exported series.
"""

from __future__ import annotations

from typing import Any

from tokenpipe.observe import metrics

# Bucket edges from the conventions' advice for each instrument.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_DURATION_BUCKETS = tuple(0.01 * 2**i for i in range(14))  # 10 ms .. 82 s
_TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))  # 1 .. 67M tokens


def bounded_model(name: str | None) -> str | None:
    """A model name as a metric attribute: only names an upstream serves (else `other`)."""
    if name is None:
        return None
    return name if metrics.model_known(name) else metrics.OTHER


class GenAIMetrics:
    """The four instruments of the conventions that a gateway can measure."""

    def __init__(self, meter: Any) -> None:
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS,
        )
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token generated after the first token.",
            explicit_bucket_boundaries_advisory=_TPOT_BUCKETS,
        )
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Generative AI server request duration (to the last byte).",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self.tokens = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
        )

    def record(
        self,
        *,
        operation: str,
        provider: str,
        model: str,
        response_model: str | None,
        status: int,
        duration: float,
        ttft: float | None,
        tpot: float | None,
        usage: dict[str, Any] | None,
    ) -> None:
        attrs: dict[str, Any] = {"gen_ai.operation.name": operation}
        if provider:
            attrs["gen_ai.provider.name"] = provider
        request_model = bounded_model(model)
        if request_model:
            attrs["gen_ai.request.model"] = request_model
        answered = bounded_model(response_model)
        if answered:
            attrs["gen_ai.response.model"] = answered
        ok = status < 400
        if not ok:
            attrs["error.type"] = metrics.status_label(str(status))
        self.duration.record(duration, attrs)
        if not ok:
            return
        if ttft is not None:
            self.ttft.record(ttft, attrs)
        if tpot is not None:
            self.tpot.record(tpot, attrs)
        if usage:
            for kind, field in (("input", "prompt_tokens"), ("output", "completion_tokens")):
                n = usage.get(field)
                if isinstance(n, int) and n >= 0:
                    self.tokens.record(n, {**attrs, "gen_ai.token.type": kind})
