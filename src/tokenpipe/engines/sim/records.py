"""One request as the sim saw it: the record that /sim/stats reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Record:
    id: str
    kind: str
    started: float  # time.monotonic(), comparable across processes on one machine
    fault: str | None = None
    status: int = 200
    outcome: str = "running"  # running | completed | cancelled | reset | truncated | error
    ended: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    traceparent: str | None = None  # the W3C trace context the request came with
