"""The GenAI metrics as tokenpipe aggregates them (observe/genai.py) and exports them
(observe/genai_export.py), against what the OpenTelemetry metrics SDK exports for the same
measurements: both sent by the SDK's own OTLP exporters to a real receiver on loopback
(tests/otlp_receiver.py), and the decoded messages compared."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
    OTLPMetricExporter as HttpExporter,
)
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from tests.otlp_receiver import Receiver
from tokenpipe.observe import genai, metrics
from tokenpipe.observe.genai import GenAIMetrics
from tokenpipe.observe.genai_export import Export

RESOURCE = Resource.create({"service.name": "genai-test"})
USAGE = {"prompt_tokens": 40, "completion_tokens": 7}
#: Requests as the gateway records them: ok and failed, usage or none, values on bucket
#: edges (0.01 s, 4 tokens), at zero, past the last edge, one model no upstream serves.
RECORDS: list[dict[str, Any]] = [
    dict(status=200, duration=0.25, ttft=0.01, tpot=0.02, usage=USAGE),
    dict(status=200, duration=0.01, ttft=0.0, tpot=None, usage={"prompt_tokens": 4}),
    dict(status=200, duration=120.0, ttft=3.0, tpot=5.0, usage=USAGE),
    dict(status=429, duration=0.002, ttft=None, tpot=None, usage=None),
    dict(status=502, duration=0.5, ttft=0.3, tpot=None, usage=USAGE),
    dict(status=200, duration=1.0, ttft=0.05, tpot=0.03, usage=USAGE, model="unknown"),
    dict(status=200, duration=2.0, ttft=0.06, tpot=0.04, usage=None, provider=""),
]


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    metrics.allow_model("genai-model")
    with Receiver() as r:
        yield r


def _exporter(receiver: Receiver, protocol: str) -> Any:
    if protocol == "grpc":
        return GrpcExporter(endpoint=receiver.grpc_url, insecure=True)
    return HttpExporter(endpoint=receiver.http_url + "/v1/metrics")


def _record(m: GenAIMetrics, r: dict[str, Any]) -> None:
    m.record(
        operation="chat",
        provider=r.get("provider", "openai"),
        model=r.get("model", "genai-model"),
        response_model=r.get("model", "genai-model"),
        status=r["status"],
        duration=r["duration"],
        ttft=r["ttft"],
        tpot=r["tpot"],
        usage=r["usage"],
    )


def _failed(m: GenAIMetrics, operation: str, duration: float = 0.1) -> None:
    """A request that failed (500) after `duration` s: a duration point alone."""
    m.record(
        operation=operation,
        provider="openai",
        model="genai-model",
        response_model=None,
        status=500,
        duration=duration,
        ttft=None,
        tpot=None,
        usage=None,
    )


def _sdk_record(instruments: dict[str, Any], r: dict[str, Any]) -> None:
    """The same request through the SDK's instruments, with the attributes the gateway
    recorded through them before it aggregated them itself."""
    key = (
        "chat",
        r.get("provider", "openai") or None,
        genai.bounded_model(r.get("model", "genai-model")),
        genai.bounded_model(r.get("model", "genai-model")),
        None if r["status"] < 400 else metrics.status_label(str(r["status"])),
    )
    attrs = genai.attributes(key)
    instruments["gen_ai.server.request.duration"].record(r["duration"], attrs)
    if r["status"] >= 400:
        return
    if r["ttft"] is not None:
        instruments["gen_ai.server.time_to_first_token"].record(r["ttft"], attrs)
    if r["tpot"] is not None:
        instruments["gen_ai.server.time_per_output_token"].record(r["tpot"], attrs)
    for kind, field in (("input", "prompt_tokens"), ("output", "completion_tokens")):
        n = (r["usage"] or {}).get(field)
        if n is not None:
            instruments["gen_ai.client.token.usage"].record(n, {**attrs, genai.TOKEN_TYPE: kind})


def _decoded(raw: list[bytes]) -> dict[str, Any]:
    """Each exported metric's definition and points, timestamps left out, in a stable order."""
    out: dict[str, Any] = {}
    for body in raw:
        req = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    points = sorted(
                        (
                            sorted((a.key, str(a.value).strip()) for a in p.attributes),
                            p.count,
                            p.sum,
                            list(p.bucket_counts),
                            list(p.explicit_bounds),
                            p.min,
                            p.max,
                        )
                        for p in m.histogram.data_points
                    )
                    temporality = m.histogram.aggregation_temporality
                    out[m.name] = (m.unit, m.description, temporality, points)
    return out


def _take(receiver: Receiver) -> list[bytes]:
    with receiver.received.lock:
        raw = [b for b in receiver.received.raw]
        receiver.received.raw.clear()
    return raw


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_the_points_are_the_sdks_for_the_same_requests(receiver: Receiver, protocol: str) -> None:
    reader = PeriodicExportingMetricReader(
        _exporter(receiver, protocol), export_interval_millis=float("inf")
    )
    provider = MeterProvider(resource=RESOURCE, metric_readers=[reader])
    meter = provider.get_meter("tokenpipe", "test")
    ours = GenAIMetrics()
    instruments = {
        h.name: meter.create_histogram(
            h.name,
            unit=h.unit,
            description=h.description,
            explicit_bucket_boundaries_advisory=h.bounds,
        )
        for h in ours.instruments
    }
    for r in RECORDS:
        _sdk_record(instruments, r)
    _take(receiver)
    reader.collect()  # exports once (an infinite interval: never by itself)
    provider.shutdown()
    theirs = _decoded(_take(receiver))

    export = Export(ours, _exporter(receiver, protocol), RESOURCE, "test")
    for r in RECORDS:
        _record(ours, r)
    export.shutdown()  # exports once
    mine = _decoded(_take(receiver))

    assert set(mine) == {h.name for h in ours.instruments}
    assert mine == theirs
    status = ("error.type", 'string_value: "429"')
    failed = [p for p in mine["gen_ai.server.request.duration"][3] if status in p[0]]
    assert len(failed) == 1 and failed[0][1] == 1


def test_delta_exports_hold_only_what_came_since_the_last(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "lowmemory")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "3600000")  # exports by hand here
    ours = GenAIMetrics()
    export = Export(ours, _exporter(receiver, "http/protobuf"), RESOURCE, "test")
    try:
        _take(receiver)
        for r in RECORDS[:3]:
            _record(ours, r)
        export.export()
        first = _decoded(_take(receiver))
        export.export()  # nothing since: nothing sent
        assert _take(receiver) == []
        _record(ours, RECORDS[0])
        export.export()
        second_raw = _take(receiver)
        second = _decoded(second_raw)
    finally:
        export.shutdown()
    duration = "gen_ai.server.request.duration"
    assert first[duration][2] == second[duration][2] == 1  # AGGREGATION_TEMPORALITY_DELTA
    assert sum(p[1] for p in first[duration][3]) == 3
    assert [p[1] for p in second[duration][3]] == [1]
    assert second[duration][3][0][2] == RECORDS[0]["duration"]
    # The second interval starts where the first ended.
    req = metrics_service_pb2.ExportMetricsServiceRequest.FromString(second_raw[0])
    point = req.resource_metrics[0].scope_metrics[0].metrics[0].histogram.data_points[0]
    assert point.start_time_unix_nano < point.time_unix_nano


def test_past_max_series_requests_count_in_one_overflow_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(genai, "MAX_SERIES", 3)
    ours = GenAIMetrics()
    for operation in ("a", "b", "c", "d", "e"):
        _failed(ours, operation)
    points = dict(next(p for h, p in ours.collect(False) if h is ours.duration))
    assert len(points) == 4
    assert points[genai.OVERFLOW].n == 2
    assert genai.attributes(genai.OVERFLOW) == {"otel.metric.overflow": True}
    assert {k[0] for k in points if k is not genai.OVERFLOW} == {"a", "b", "c"}


def test_values_no_histogram_can_hold_are_not_recorded() -> None:
    ours = GenAIMetrics()
    hostile: list[dict[str, Any]] = [
        {"prompt_tokens": 10**30, "completion_tokens": True},
        {"prompt_tokens": -1, "completion_tokens": 2.5},
        {"prompt_tokens": "40", "completion_tokens": None},
    ]
    for usage in hostile:
        ours.record(
            operation="chat",
            provider="openai",
            model="genai-model",
            response_model=None,
            status=200,
            duration=float("nan"),
            ttft=float("inf"),
            tpot=-1.0,
            usage=usage,
        )
    assert all(not points for _, points in ours.collect(False))


def test_an_export_interval_not_above_zero_is_refused(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "0")
    with pytest.raises(ValueError, match="not above 0"):
        Export(GenAIMetrics(), _exporter(receiver, "http/protobuf"), RESOURCE, "test")


def test_a_cumulative_export_copies_every_point_batch_by_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(genai, "COPY_BATCH", 2)  # 5 points: batches of 2, 2 and 1
    ours = GenAIMetrics()
    for i in range(5):
        for _ in range(i + 1):
            _failed(ours, f"op{i}", 0.1 * (i + 1))
    first = dict(next(p for h, p in ours.collect(False) if h is ours.duration))
    assert {k[0]: p.n for k, p in first.items()} == {f"op{i}": i + 1 for i in range(5)}
    # Copies: a request recorded after the export leaves them as they were.
    _failed(ours, "op0")
    op0 = next(p for k, p in first.items() if k[0] == "op0")
    assert (op0.n, sum(op0.counts)) == (1, 1)
    again = dict(next(p for h, p in ours.collect(False) if h is ours.duration))
    assert next(p for k, p in again.items() if k[0] == "op0").n == 2
