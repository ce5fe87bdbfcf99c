"""What one response did, as the client saw it: first token, gaps, tokens, outcome."""

from __future__ import annotations

import time
from typing import Any

from tokenpipe.observe import metrics, tracing


class StreamTally:
    """The per-request measurements, observed into the metrics when the request ends (and
    into its trace: tracing.OFF when untraced)."""

    __slots__ = (
        "chunks",
        "deltas",
        "done",
        "finished",
        "first_token_at",
        "itl",
        "last_token_at",
        "max_gap",
        "series",
        "started_at",
        "trace",
        "ttft",
        "usage",
    )

    def __init__(
        self,
        upstream: str,
        model: str,
        started_at: float,
        api: str = "chat",
        trace: tracing.RequestTrace = tracing.OFF,
    ) -> None:
        # The request metrics' labels (observe/metrics.REQUEST_LABELS); `api` is the route's
        # (Dialect.label), one of metrics.APIS.
        self.series = metrics.request_series(api, upstream, model)
        self.trace = trace
        self.started_at = started_at  # time.perf_counter() at request arrival
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.max_gap = 0.0  # seconds: the longest gap between content events (Server-Timing)
        self.chunks = 0  # content events sent to the client
        self.deltas = 0  # upstream content deltas sent (several per event when merged)
        self.usage: dict[str, Any] | None = None
        self.done = False  # the stream's own last event seen ([DONE]; not an error event)
        self.finished = False  # a finish_reason (or the upstream's error event) seen
        self.ttft: float | None = None
        self.itl = self.series.itl

    def observe_content(self, now: float, deltas: int) -> None:
        """A content event sent to the client at `now`, carrying `deltas` upstream deltas."""
        self.deltas += deltas
        if self.first_token_at is None:
            self.first_token_at = now
            self.ttft = now - self.started_at
            self.series.ttft.observe(self.ttft)
            self.trace.first_token(self.ttft)
        else:
            gap = now - self.last_token_at
            self.itl.observe(gap)
            if gap > self.max_gap:
                self.max_gap = gap
        self.last_token_at = now
        self.chunks += 1

    def finish(self, status: int) -> None:
        end = time.perf_counter()
        series = self.series
        series.duration.observe(end - self.started_at)
        series.requests(status).inc()
        usage = self.usage
        tpot = None
        if usage:
            prompt = usage.get("prompt_tokens") or 0
            completion = usage.get("completion_tokens") or 0
            series.prompt.inc(prompt)
            series.completion.inc(completion)
            if self.first_token_at is not None and completion > 1:
                tpot = (self.last_token_at - self.first_token_at) / (completion - 1)
                series.tpot.observe(tpot)
        self.trace.finish(
            status, end - self.started_at, self.ttft, tpot, usage, self.chunks, self.deltas
        )
