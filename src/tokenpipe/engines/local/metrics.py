"""Metrics of the local engine, on the one registry (`tokenpipe_local_*`, seconds)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from tokenpipe.engines.local.decode import Record
from tokenpipe.observe.metrics import REGISTRY

# Queue waits span nothing (idle model) to the wait deadline; prefill of a 270M model on a CPU
# is milliseconds for a short prompt and seconds for a long one.
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
_TPS_BUCKETS = (5, 10, 20, 30, 40, 50, 60, 80, 100, 150, 200, 300, 500)

QUEUE = Histogram(
    "tokenpipe_local_queue_seconds",
    "Time a request waited for the model.",
    buckets=_WAIT_BUCKETS,
    registry=REGISTRY,
)
PREFILL = Histogram(
    "tokenpipe_local_prefill_seconds",
    "llama.cpp prompt-eval time per request.",
    buckets=_WAIT_BUCKETS,
    registry=REGISTRY,
)
DECODE = Histogram(
    "tokenpipe_local_decode_seconds",
    "llama.cpp eval time per request (compute only, pauses excluded).",
    buckets=_WAIT_BUCKETS,
    registry=REGISTRY,
)
TOKENS_PER_SECOND = Histogram(
    "tokenpipe_local_decode_tokens_per_second",
    "Decode speed per request, from llama.cpp's eval time.",
    buckets=_TPS_BUCKETS,
    registry=REGISTRY,
)
PAUSED = Counter(
    "tokenpipe_local_paused_seconds",
    "Time decoding waited for slow clients (backpressure).",
    registry=REGISTRY,
)
TOKENS = Counter(
    "tokenpipe_local_tokens",
    "Tokens, by kind (prompt or completion).",
    ("kind",),
    registry=REGISTRY,
)
REQUESTS = Counter(
    "tokenpipe_local_requests", "Generations, by outcome.", ("outcome",), registry=REGISTRY
)
REJECTED = Counter(
    "tokenpipe_local_rejected",
    "Requests refused by the queue, by reason.",
    ("reason",),
    registry=REGISTRY,
)
WAITING = Gauge("tokenpipe_local_queue_depth", "Requests waiting for the model.", registry=REGISTRY)


def observe(rec: Record) -> None:
    QUEUE.observe(rec.queue_ms / 1000)
    PREFILL.observe(rec.prefill_ms / 1000)
    DECODE.observe(rec.decode_ms / 1000)
    if rec.tokens_per_second > 0:
        TOKENS_PER_SECOND.observe(rec.tokens_per_second)
    PAUSED.inc(rec.paused_ms / 1000)
    TOKENS.labels("prompt").inc(rec.prompt_tokens)
    TOKENS.labels("completion").inc(rec.completion_tokens)
    REQUESTS.labels(rec.outcome).inc()
