"""LLM latency metrics for one request and their mergeable summaries.

Definitions (the same in bench, doctor and the gateway):

- TTFT: request sent -> first chunk with content, reasoning or a tool call (a role-only first
  chunk does not count: `tokenpipe.dialects.openai.chunk_has_content`).
- ITL per chunk: gaps between consecutive content chunks (TTFT is not a gap).
- ITL per token: each chunk gap divided by the tokens that chunk carried. Token counts come from
  `usage.completion_tokens`, spread evenly over the content chunks (an SSE chunk does not say how
  many tokens it holds); a protocol that reports tokens per chunk (gRPC) gives exact counts.
- TPOT: (last content chunk - first content chunk) / (output tokens - 1).
- e2e: request sent -> end of the response.

Percentiles come from HDR histograms (microsecond resolution, 3 significant digits), which merge
exactly across tasks, runs and processes.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hdrh.histogram import HdrHistogram

#: Metric names of a summary, each a latency distribution in milliseconds.
LATENCY_METRICS = ("ttft_ms", "itl_token_ms", "itl_chunk_ms", "tpot_ms", "e2e_ms")

_MAX_US = 3_600_000_000  # one hour in microseconds: the largest value a sketch records


class LatencySketch:
    """A latency distribution (values in seconds, kept in microseconds). Mergeable."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = HdrHistogram(1, _MAX_US, 3)

    def record(self, seconds: float, count: int = 1) -> None:
        us = int(seconds * 1e6 + 0.5)
        self._h.record_value(min(max(us, 1), _MAX_US), count)

    def merge(self, other: LatencySketch) -> LatencySketch:
        self._h.add(other._h)
        return self

    @property
    def count(self) -> int:
        return int(self._h.get_total_count())

    def quantile_ms(self, q: float) -> float | None:
        """q in 0..1; None when empty."""
        if not self.count:
            return None
        return self._h.get_value_at_percentile(q * 100.0) / 1000.0

    def mean_ms(self) -> float | None:
        return self._h.get_mean_value() / 1000.0 if self.count else None

    def stats(self) -> dict[str, float | None]:
        """`{p50, p90, p99, mean}` in milliseconds (None when empty)."""
        return {
            "p50": _r(self.quantile_ms(0.5)),
            "p90": _r(self.quantile_ms(0.9)),
            "p99": _r(self.quantile_ms(0.99)),
            "mean": _r(self.mean_ms()),
        }

    def to_text(self) -> str:
        """Compressed, base64: ship a sketch between processes or store it next to results."""
        return base64.b64encode(self._h.encode()).decode()

    @classmethod
    def from_text(cls, text: str) -> LatencySketch:
        s = cls()
        s._h.add(HdrHistogram.decode(base64.b64decode(text)))
        return s


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


@dataclass(slots=True)
class RequestRecord:
    """What one request did, as the client saw it. Times are `time.perf_counter()` seconds."""

    index: int = 0
    protocol: str = "sse"
    label: str = ""
    sent_at: float = 0.0
    headers_at: float | None = None
    end_at: float | None = None
    #: Arrival time of each content chunk (events read in one socket read share one time).
    chunk_times: list[float] = field(default_factory=list)
    #: Tokens in each content chunk when the protocol says so (gRPC), else empty.
    chunk_tokens: list[int] = field(default_factory=list)
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    status: int = 0
    error: str | None = None
    finish_reason: str | None = None
    http_version: str = ""
    #: Server-reported phases in ms (x-tokenpipe-* headers, `: tokenpipe ...` SSE comment).
    server_ms: dict[str, float] = field(default_factory=dict)
    temperature: float | None = None
    #: Open loop: seconds the request went out after its scheduled arrival.
    schedule_lag: float = 0.0
    #: Closed loop: the user (0 .. concurrency-1) that sent it; -1 otherwise.
    user: int = -1

    @property
    def ok(self) -> bool:
        return self.error is None and self.status in (0, 200) and self.end_at is not None

    @property
    def first_token_at(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def ttft(self) -> float | None:
        """Seconds from send to the first content chunk."""
        ft = self.first_token_at
        return None if ft is None else ft - self.sent_at

    @property
    def e2e(self) -> float | None:
        return None if self.end_at is None else self.end_at - self.sent_at

    @property
    def output_tokens(self) -> int:
        """From usage when reported, else the per-chunk counts, else one token per chunk."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        if self.chunk_tokens:
            return sum(self.chunk_tokens)
        return len(self.chunk_times)

    @property
    def tokens_per_chunk(self) -> float:
        n = len(self.chunk_times)
        return self.output_tokens / n if n else 0.0

    def itl_chunks(self) -> list[float]:
        """Seconds between consecutive content chunks."""
        t = self.chunk_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]

    def itl_tokens(self) -> list[tuple[float, int]]:
        """(per-token gap in seconds, tokens it applies to) for each chunk gap."""
        gaps = self.itl_chunks()
        if not gaps:
            return []
        counts: list[float]
        if len(self.chunk_tokens) == len(self.chunk_times):
            counts = [float(n) for n in self.chunk_tokens[1:]]
        else:
            counts = [self.tokens_per_chunk] * len(gaps)
        out = []
        for gap, n in zip(gaps, counts, strict=True):
            n = max(n, 1.0)
            out.append((gap / n, max(1, round(n))))
        return out

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        if len(self.chunk_times) < 2 or n < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (n - 1)

    def to_json(self, origin: float) -> dict[str, Any]:
        """Timings in ms; `start_ms` relative to `origin` (the run's start)."""

        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1000.0, 3)

        return {
            "index": self.index,
            "run": self.label,
            "protocol": self.protocol,
            "ok": self.ok,
            "status": self.status,
            "error": self.error,
            "start_ms": ms(self.sent_at - origin),
            "headers_ms": ms(None if self.headers_at is None else self.headers_at - self.sent_at),
            "ttft_ms": ms(self.ttft),
            "e2e_ms": ms(self.e2e),
            "tpot_ms": ms(self.tpot),
            "output_tokens": self.output_tokens,
            "chunks": len(self.chunk_times),
            "tokens_from_usage": self.usage_completion_tokens is not None,
            "itl_chunk_ms": [round(g * 1000.0, 3) for g in self.itl_chunks()],
            "http_version": self.http_version,
            "temperature": self.temperature,
            "server_ms": self.server_ms or None,
            "schedule_lag_ms": ms(self.schedule_lag),
        }


@dataclass(slots=True)
class SLO:
    """Goodput targets in seconds; a request is good when it is ok and meets every target."""

    ttft: float | None = None
    tpot: float | None = None
    itl: float | None = None  # the request's worst per-token gap
    e2e: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft, r.ttft), (self.tpot, r.tpot), (self.e2e, r.e2e))
        for target, value in checks:
            if target is not None and (value is None or value > target):
                return False
        if self.itl is not None:
            worst = max((g for g, _ in r.itl_tokens()), default=0.0)
            if worst > self.itl:
                return False
        return True

    def to_json(self) -> dict[str, float]:
        return {
            f"{k}_ms": v * 1000.0
            for k, v in (
                ("ttft", self.ttft),
                ("tpot", self.tpot),
                ("itl", self.itl),
                ("e2e", self.e2e),
            )
            if v is not None
        }


def parse_slo(text: str) -> SLO:
    """`ttft=500ms,tpot=50ms` (units ms or s; a bare number is ms)."""
    slo = SLO()
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "itl", "e2e"):
            raise ValueError(f"bad SLO {part!r}: use ttft=, tpot=, itl= or e2e=, e.g. ttft=500ms")
        setattr(slo, key, parse_duration(value))
    return slo


def parse_duration(value: str) -> float:
    """'500ms', '1.5s', '200' (ms) -> seconds: finite and above 0."""
    v = value.strip().lower()
    try:
        if v.endswith("ms"):
            seconds = float(v[:-2]) / 1000.0
        elif v.endswith("s"):
            seconds = float(v[:-1])
        else:
            seconds = float(v) / 1000.0
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"bad duration {value!r}: use e.g. 500ms or 1.5s (above 0)")
    return seconds


@dataclass(slots=True)
class Summary:
    """Sketches and counters of a set of requests. `merge` combines runs or processes."""

    sketches: dict[str, LatencySketch] = field(
        default_factory=lambda: {m: LatencySketch() for m in LATENCY_METRICS}
    )
    requests_ok: int = 0
    requests_failed: int = 0
    requests_good: int = 0
    output_tokens: int = 0
    chunks: int = 0
    #: Wall time of the run (seconds): first send to last end.
    wall_s: float = 0.0
    slo: SLO | None = None

    def add(self, r: RequestRecord) -> None:
        if not r.ok:
            self.requests_failed += 1
            return
        self.requests_ok += 1
        s = self.sketches
        if r.ttft is not None:
            s["ttft_ms"].record(r.ttft)
        s["e2e_ms"].record(r.e2e or 0.0)
        tpot = r.tpot
        if tpot is not None:
            s["tpot_ms"].record(tpot)
        chunk = s["itl_chunk_ms"]
        for g in r.itl_chunks():
            chunk.record(g)
        tok = s["itl_token_ms"]
        for g, n in r.itl_tokens():
            tok.record(g, n)
        self.output_tokens += r.output_tokens
        self.chunks += len(r.chunk_times)
        if self.slo is None or self.slo.met(r):
            self.requests_good += 1

    def merge(self, other: Summary) -> Summary:
        """Combine two summaries. Wall time is the longer one: merged parts ran side by side
        (processes of one run). For runs one after another, set `wall_s` to their sum."""
        for k, sk in other.sketches.items():
            self.sketches[k].merge(sk)
        self.requests_ok += other.requests_ok
        self.requests_failed += other.requests_failed
        self.requests_good += other.requests_good
        self.output_tokens += other.output_tokens
        self.chunks += other.chunks
        self.wall_s = max(self.wall_s, other.wall_s)
        return self

    def to_json(self) -> dict[str, Any]:
        wall = self.wall_s
        total = self.requests_ok + self.requests_failed
        out: dict[str, Any] = {m: self.sketches[m].stats() for m in LATENCY_METRICS}
        out.update(
            {
                "output_tokens_per_s": round(self.output_tokens / wall, 3) if wall > 0 else None,
                "requests_per_s": round(self.requests_ok / wall, 3) if wall > 0 else None,
                "requests_ok": self.requests_ok,
                "requests_failed": self.requests_failed,
                # Good requests per second: ok and within every SLO (all ok requests without one).
                "goodput": round(self.requests_good / wall, 3) if wall > 0 else None,
                "goodput_fraction": round(self.requests_good / total, 4) if total else None,
                "slo": self.slo.to_json() if self.slo else None,
                "output_tokens": self.output_tokens,
                "tokens_per_chunk": round(self.output_tokens / self.chunks, 3)
                if self.chunks
                else None,
                "wall_s": round(wall, 3),
                "sketches": {m: self.sketches[m].to_text() for m in LATENCY_METRICS},
            }
        )
        return out


def summarise(
    records: Iterable[RequestRecord], *, slo: SLO | None = None, wall_s: float | None = None
) -> Summary:
    """Summary of finished requests. Wall time defaults to first send -> last end."""
    s = Summary(slo=slo)
    first, last = float("inf"), float("-inf")
    for r in records:
        s.add(r)
        first = min(first, r.sent_at)
        if r.end_at is not None:
            last = max(last, r.end_at)
    s.wall_s = wall_s if wall_s is not None else (max(0.0, last - first) if last > first else 0.0)
    return s
