"""The GenAI semantic conventions' metrics, exported over OTLP when a metrics endpoint is set
(observe/otel.py starts the export, observe/genai_export.py); Prometheus (observe/metrics.py)
is unchanged.

One request records once, when it ends (`GenAIMetrics.record`): attribute values are bounded
as Prometheus labels are (a model name no upstream serves is `other`), so a client cannot grow
the exported series; each instrument holds at most MAX_SERIES of them besides.

The histograms are kept here, not by the OpenTelemetry metrics SDK, whose `Histogram.record`
checks, cleans and hashes every attribute of every measurement again: a request's four
records cost 36 us (timeit), and with the metrics on a 1-token request ran 1,195k machine
instructions against 769k without (benchmarks/request_instructions.py --otlp metrics). Here
a request's attributes are one tuple, which finds each instrument's point in one dict
lookup. What is exported is the SDK's own data (its `HistogramDataPoint`), sent by its OTLP
exporter: the same points, buckets and temporality as the SDK's reader sent.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from typing import Any

from tokenpipe.observe import metrics

# Bucket edges from the conventions' advice for each instrument.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_DURATION_BUCKETS = tuple(0.01 * 2**i for i in range(14))  # 10 ms .. 82 s
_TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))  # 1 .. 67M tokens

#: Attribute sets one instrument holds (the SDK's default cardinality limit). Past it a
#: request is counted in one more point, `otel.metric.overflow=true`, as the SDK does.
MAX_SERIES = 2000
#: A token count believed from an upstream's usage; a larger one is not recorded.
MAX_TOKENS = 1 << 53
#: The attributes of a request, in the order of its key's values (None: absent).
NAMES = (
    "gen_ai.operation.name",
    "gen_ai.provider.name",
    "gen_ai.request.model",
    "gen_ai.response.model",
    "error.type",
)
TOKEN_TYPE = "gen_ai.token.type"
OVERFLOW: tuple[Any, ...] = ("overflow",)
#: Points copied under one hold of the lock by an export (see `GenAIMetrics.collect`).
COPY_BATCH = 256


def bounded_model(name: str | None) -> str | None:
    """A model name as a metric attribute: only names an upstream serves (else `other`)."""
    if name is None:
        return None
    return name if metrics.model_known(name) else metrics.OTHER


class Point:
    """One attribute set's histogram: the count in each bucket, their sum, count, least and
    greatest, since `since` (ns since the epoch)."""

    __slots__ = ("counts", "high", "low", "n", "since", "total")

    def __init__(self, buckets: int, since: int) -> None:
        self.counts = [0] * buckets
        self.total = 0.0
        self.n = 0
        self.low = math.inf
        self.high = -math.inf
        self.since = since

    def copy(self) -> Point:
        c = Point(0, self.since)
        c.counts, c.total, c.n, c.low, c.high = (
            self.counts[:],
            self.total,
            self.n,
            self.low,
            self.high,
        )
        return c


class Histogram:
    """One instrument: its name, unit, description, bucket edges and points by key."""

    __slots__ = ("bounds", "description", "name", "points", "unit")

    def __init__(self, name: str, unit: str, description: str, bounds: tuple[float, ...]):
        self.name = name
        self.unit = unit
        self.description = description
        self.bounds = bounds
        self.points: dict[tuple[Any, ...], Point] = {}

    def add(self, key: tuple[Any, ...], value: float) -> None:
        """Records `value` (finite, >= 0: the caller's) under `key`. Called with the lock."""
        point = self.points.get(key)
        if point is None:
            if len(self.points) >= MAX_SERIES:
                key = OVERFLOW
                point = self.points.get(key)
            if point is None:
                point = self.points[key] = Point(len(self.bounds) + 1, time.time_ns())
        # An edge's bucket holds the values up to it, the edge included (OTLP's explicit
        # buckets; the SDK's bisect_left too).
        point.counts[bisect_left(self.bounds, value)] += 1
        point.total += value
        point.n += 1
        if value < point.low:
            point.low = value
        if value > point.high:
            point.high = value


class GenAIMetrics:
    """The four instruments of the conventions that a gateway can measure. `record` runs on
    the event loop, `collect` on the export thread: both under one lock, held for a
    request's few additions or for copying the points (no I/O under it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft = Histogram(
            "gen_ai.server.time_to_first_token",
            "s",
            "Time to generate first token for successful responses.",
            _TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            "gen_ai.server.time_per_output_token",
            "s",
            "Time per output token generated after the first token.",
            _TPOT_BUCKETS,
        )
        self.duration = Histogram(
            "gen_ai.server.request.duration",
            "s",
            "Generative AI server request duration (to the last byte).",
            _DURATION_BUCKETS,
        )
        self.tokens = Histogram(
            "gen_ai.client.token.usage",
            "{token}",
            "Number of input and output tokens used.",
            _TOKEN_BUCKETS,
        )
        self.instruments = (self.ttft, self.tpot, self.duration, self.tokens)

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
        ok = status < 400
        key = (
            operation,
            provider or None,
            bounded_model(model) or None,
            bounded_model(response_model) or None,
            None if ok else metrics.status_label(str(status)),
        )
        with self.lock:
            if _valid(duration):
                self.duration.add(key, duration)
            if not ok:
                return
            if ttft is not None and _valid(ttft):
                self.ttft.add(key, ttft)
            if tpot is not None and _valid(tpot):
                self.tpot.add(key, tpot)
            if usage:
                n = usage.get("prompt_tokens")
                if type(n) is int and 0 <= n <= MAX_TOKENS:
                    self.tokens.add((*key, "input"), n)
                n = usage.get("completion_tokens")
                if type(n) is int and 0 <= n <= MAX_TOKENS:
                    self.tokens.add((*key, "output"), n)

    def collect(self, delta: bool) -> list[tuple[Histogram, list[tuple[tuple[Any, ...], Point]]]]:
        """Each instrument with a copy of its points. `delta`: the points are dropped once
        copied (each export then holds what was recorded since the last one).

        Each point is copied whole under the lock (its sum with its count), COPY_BATCH at a
        time: at the bound (4 x MAX_SERIES points) one copy under one lock held the event
        loop 7.6 ms; a batch holds it ~0.25 ms. A delta export takes the points themselves,
        which no request adds to once they are swapped out."""
        out = []
        for h in self.instruments:
            with self.lock:
                items = list(h.points.items())
                if delta:
                    h.points = {}
            if delta:
                out.append((h, items))
                continue
            copies = []
            for start in range(0, len(items), COPY_BATCH):
                with self.lock:
                    for key, p in items[start : start + COPY_BATCH]:
                        copies.append((key, p.copy()))
            out.append((h, copies))
        return out


def _valid(seconds: float) -> bool:
    """A measurement the conventions can hold: finite and not negative (as the SDK drops)."""
    return 0.0 <= seconds < math.inf


def attributes(key: tuple[Any, ...]) -> dict[str, Any]:
    """A point's attributes from its key (`tokens`' keys end with the token type)."""
    if key == OVERFLOW:
        return {"otel.metric.overflow": True}
    own = zip(NAMES, key[: len(NAMES)], strict=True)
    attrs = {name: value for name, value in own if value is not None}
    if len(key) > len(NAMES):
        attrs[TOKEN_TYPE] = key[len(NAMES)]
    return attrs
