"""The GenAI metrics' export: a thread of its own that every `OTEL_METRIC_EXPORT_INTERVAL`
ms (60 s by default) copies the histograms (observe/genai.py) into the OpenTelemetry SDK's
metric data and hands it to an OTLP metric exporter, once more at shutdown, as the SDK's
`PeriodicExportingMetricReader` does. Each export waits at most `OTEL_METRIC_EXPORT_TIMEOUT`
ms (30 s by default); one that fails is logged by the exporter and the next goes on.

Temporality as `OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE` asks: cumulative by
default; `delta` or `lowmemory` (both make histograms delta): each export holds what was
recorded since the one before, starting where it ended.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from tokenpipe.observe.genai import GenAIMetrics, attributes

log = logging.getLogger("tokenpipe.observe")


def _millis(name: str, default: float) -> float:
    """An OTEL_* duration in ms, as the SDK's reader reads it: a value that is not a number
    gives `default` (with a warning)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        log.warning("OpenTelemetry: %s=%r is not a number of ms; using %g", name, text, default)
        return default


def delta_asked() -> bool:
    preference = os.environ.get("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "")
    return preference.strip().upper() in ("DELTA", "LOWMEMORY")


class Export:
    """Sends `metrics` through `exporter` from its own daemon thread until `shutdown`."""

    def __init__(self, metrics: GenAIMetrics, exporter: Any, resource: Any, version: str) -> None:
        """Raises ValueError for an export interval that is not above 0."""
        self.metrics = metrics
        self.exporter = exporter
        self.resource = resource
        self.scope = InstrumentationScope("tokenpipe", version)
        interval = _millis("OTEL_METRIC_EXPORT_INTERVAL", 60_000.0)
        if not interval > 0:  # (the SDK's reader refuses it too: setup turns OTLP off)
            exporter.shutdown()  # never used: its connections go now
            raise ValueError(f"the metric export interval {interval:g} ms is not above 0")
        self.interval = interval / 1000  # inf: exported at shutdown only
        self.timeout_ms = _millis("OTEL_METRIC_EXPORT_TIMEOUT", 30_000.0)
        self.delta = delta_asked()
        self.last = time.time_ns()  # a delta export's start: where the one before ended
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one export at a time (the thread's, shutdown's)
        self._thread = threading.Thread(
            target=self._run, name="tokenpipe-genai-export", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        if self.interval == float("inf"):
            return
        while not self._stop.wait(self.interval):
            self.export()

    def data(self) -> MetricsData | None:
        """The histograms as the SDK's metric data (None: nothing recorded)."""
        now = time.time_ns()
        temporality = AggregationTemporality.CUMULATIVE
        if self.delta:
            temporality = AggregationTemporality.DELTA
        found = []
        for h, points in self.metrics.collect(self.delta):
            if not points:
                continue
            bounds = list(h.bounds)
            data_points = [
                HistogramDataPoint(
                    attributes=attributes(key),
                    start_time_unix_nano=self.last if self.delta else p.since,
                    time_unix_nano=now,
                    count=p.n,
                    sum=p.total,
                    bucket_counts=p.counts,
                    explicit_bounds=bounds,
                    min=p.low,
                    max=p.high,
                )
                for key, p in points
            ]
            found.append(Metric(h.name, h.description, h.unit, Histogram(data_points, temporality)))
        self.last = now
        if not found:
            return None
        scope = ScopeMetrics(self.scope, found, "")
        return MetricsData([ResourceMetrics(self.resource, [scope], "")])

    def export(self) -> None:
        with self._lock:
            data = self.data()
            if data is None:
                return
            try:
                self.exporter.export(data, timeout_millis=self.timeout_ms)
            except Exception:  # the thread goes on: the next interval tries again
                log.warning("OpenTelemetry: exporting the GenAI metrics failed", exc_info=True)

    def shutdown(self) -> None:
        """Stops the thread, exports what was recorded since the last export, and shuts the
        exporter down."""
        self._stop.set()
        self._thread.join(self.timeout_ms / 1000)
        self.export()
        self.exporter.shutdown()
