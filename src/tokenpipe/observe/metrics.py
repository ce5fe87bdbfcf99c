"""The one metrics registry. Names are prefixed `tokenpipe_`, seconds are the base unit."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
)

from tokenpipe.observe import exposition
from tokenpipe.observe.fastcount import FastCounter, FastGauge
from tokenpipe.observe.fasthist import FastHistogram

# `_created` series double the exposition size and no dashboard of ours reads them.
disable_created_metrics()

REGISTRY = CollectorRegistry(auto_describe=True)

#: Label children looked up per request, by (metric, label values): prometheus_client's
#: `labels()` validates, takes a lock and builds keys on every call (a few us, several times
#: per request). Bound: cleared past this many entries (then rebuilt as used).
_CHILDREN_MAX = 10_000
_children: dict[tuple[object, tuple[str, ...]], Any] = {}


#: Label values are bounded (a client must not be able to grow /metrics):
#: - model: only names configured or listed by an upstream (`allow_model`), at most
#:   MAX_MODEL_LABELS of them; any other name is folded into OTHER.
#: - status: HTTP statuses 100-599 (at most 500 values); anything else is OTHER.
#: - upstream: configured names only (bounded by the config). kind, reason, outcome,
#:   policy: fixed sets named in each metric's help. No label carries a key, tenant or path.
#: - api: APIS, from the route's dialect (`Dialect.label`), never from the client.
MAX_MODEL_LABELS = 1000
OTHER = "other"
_models: set[str] = set()
#: Position of the model / status label in each metric that has one (filled below).
_model_at: dict[object, int] = {}
_status_at: dict[object, int] = {}


def allow_model(name: str) -> None:
    """`name` was configured or listed by an upstream: it may be a label value."""
    if name not in _models and len(_models) < MAX_MODEL_LABELS:
        _models.add(name)


def model_known(name: str) -> bool:
    return name in _models


#: Statuses that are label values of their own: what the gateway answers itself and what
#: LLM APIs answer (529: Anthropic's overloaded). Any other is its class, "4xx" or "5xx":
#: an upstream's statuses pass through to the client, and each of 100-599 was a label value,
#: times the model, API and upstream labels (audit of 2026-12-06: 201 statuses from one
#: upstream made 5,025 series of tokenpipe_requests_total). Bound: 19 values + 5 classes.
STATUSES = frozenset(
    {"200", "400", "401", "403", "404", "408", "409", "413", "415", "422", "429", "431"}
    | {"499", "500", "501", "502", "503", "504", "529"}
)


def status_label(value: str) -> str:
    """A status as a label value: itself if in STATUSES, else its class ("4xx"), else OTHER."""
    if value in STATUSES:
        return value
    if len(value) == 3 and value.isdigit() and "1" <= value[0] <= "5":
        return f"{value[0]}xx"
    return OTHER


def child(metric: Any, *values: str) -> Any:
    """`metric.labels(*values)`, cached, with model and status values bounded (above)."""
    at = _model_at.get(metric)
    if at is not None and values[at] not in _models:
        values = (*values[:at], OTHER, *values[at + 1 :])
    at = _status_at.get(metric)
    if at is not None:
        values = (*values[:at], status_label(values[at]), *values[at + 1 :])
    key = (metric, values)
    found = _children.get(key)
    if found is None:
        if len(_children) >= _CHILDREN_MAX:
            _children.clear()
        found = _children[key] = metric.labels(*values)
    return found


# Bucket edges in seconds. TTFT spans a loopback sim (ms) to a loaded provider (tens of s);
# inter-token gaps live between sub-millisecond and a few hundred ms, with stalls beyond.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)

LABELS = ("upstream", "model")
#: The client APIs, values of the request metrics' `api` label (the route's, translated or not).
APIS = ("chat", "completions", "responses", "messages", "embeddings")
#: Labels of the per-request metrics: which API the client spoke, where it went, for what model.
REQUEST_LABELS = ("api", *LABELS)

# Histograms observed per request or per chunk are the cheap kind (see fasthist.py).
TTFT = FastHistogram(
    "tokenpipe_ttft_seconds",
    "Time from request arrival to the first content token sent to the client.",
    REQUEST_LABELS,
    buckets=_TTFT_BUCKETS,
    registry=REGISTRY,
)
ITL = FastHistogram(
    "tokenpipe_itl_seconds",
    "Gap between consecutive content chunks sent to the client (per chunk).",
    REQUEST_LABELS,
    buckets=_ITL_BUCKETS,
    registry=REGISTRY,
)
TPOT = FastHistogram(
    "tokenpipe_tpot_seconds",
    "Time per output token after the first: (end - first token) / (completion tokens - 1).",
    REQUEST_LABELS,
    buckets=_ITL_BUCKETS,
    registry=REGISTRY,
)
REQUEST_DURATION = FastHistogram(
    "tokenpipe_request_duration_seconds",
    "Time from request arrival to the end of the response.",
    REQUEST_LABELS,
    buckets=_DURATION_BUCKETS,
    registry=REGISTRY,
)
# The per-request counters and gauge are the cheap kind too (fastcount.py).
REQUESTS = FastCounter(
    "tokenpipe_requests",
    "Requests answered, by HTTP status (499: the client went away).",
    ("status", *REQUEST_LABELS),
    registry=REGISTRY,
)
TOKENS = FastCounter(
    "tokenpipe_tokens",
    "Tokens, by kind (prompt or completion), as reported by the upstream's usage.",
    ("kind", *REQUEST_LABELS),
    registry=REGISTRY,
)
INFLIGHT = FastGauge(
    "tokenpipe_inflight_requests",
    "Requests being served right now.",
    REQUEST_LABELS,
    registry=REGISTRY,
)


# -- rate limiting and concurrency (control/, admission) ------------------------------------
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60)

LIMITER_WAIT = FastHistogram(
    "tokenpipe_limiter_wait_seconds",
    "Time a request waited for upstream capacity (rate buckets and concurrency).",
    ("upstream",),
    buckets=_WAIT_BUCKETS,
    registry=REGISTRY,
)
UPSTREAM_429 = Counter(
    "tokenpipe_upstream_429",
    "Upstream answers with status 429 (rate limited).",
    ("upstream",),
    registry=REGISTRY,
)
CONCURRENCY_LIMIT = FastGauge(  # set on every accepted request
    "tokenpipe_concurrency_limit",
    "Current adaptive concurrency limit per upstream (requests in flight, this process).",
    ("upstream",),
    registry=REGISTRY,
)
RATELIMIT_REMAINING = FastGauge(  # set on every answer that carries rate-limit headers
    "tokenpipe_ratelimit_remaining",
    "What the upstream last said is left in its rate-limit bucket, by kind (requests, tokens).",
    ("upstream", "kind"),
    registry=REGISTRY,
)
LIMITS_FALLBACK = Gauge(
    "tokenpipe_limits_redis_fallback",
    "1 while Redis is unreachable and this process enforces a local share of each limit.",
    registry=REGISTRY,
)
ADMISSION_REJECTED = Counter(
    "tokenpipe_admission_rejected",
    "Requests rejected with 429 because their API key was over a quota, by reason.",
    ("reason",),
    registry=REGISTRY,
)


def _index_labels() -> None:
    for metric in list(globals().values()):
        names = getattr(metric, "labelnames", None) or getattr(metric, "_labelnames", None)
        if not isinstance(names, tuple):
            continue
        if "model" in names:
            _model_at[metric] = names.index("model")
        if "status" in names:
            _status_at[metric] = names.index("status")


def render() -> bytes:
    return exposition.render(REGISTRY)


async def render_async() -> bytes:
    """`render`, the event loop running between slices of series (exposition.SLICE)."""
    return await exposition.render_async(REGISTRY)


# -- context budgeting (tokenpipe.context) ---------------------------------------------------
CONTEXT_COMPRESSED = Counter(
    "tokenpipe_context_compressed",
    "Requests whose history was compressed to fit the context window, by policy applied "
    "(truncate, or summarize; a failed summary counts as truncate).",
    ("policy",),
    registry=REGISTRY,
)
CONTEXT_TOKENS_SAVED = Counter(
    "tokenpipe_context_tokens_saved",
    "Prompt tokens removed by history compression (counted or estimated before sending).",
    ("policy",),
    registry=REGISTRY,
)
CONTEXT_MAX_TOKENS_LOWERED = Counter(
    "tokenpipe_context_max_tokens_lowered",
    "Requests whose max_tokens was lowered (or set) so that prompt + output fit the window.",
    registry=REGISTRY,
)
CONTEXT_SUMMARIES = Counter(
    "tokenpipe_context_summaries",
    "Summaries of dropped history, by outcome: new, extended (a cached summary plus the new "
    "turns), reused (from the cache, no call), timeout and failed (both fell back to truncate).",
    ("outcome",),
    registry=REGISTRY,
)

# -- relay: backpressure and merging (relay/) -----------------------------------------------

STREAM_MERGED_DELTAS = Counter(
    "tokenpipe_stream_merged_deltas",
    "Upstream deltas merged into a neighbour because the client read slower than the upstream.",
    registry=REGISTRY,
)
STREAM_BUFFER_BYTES = Gauge(
    "tokenpipe_stream_buffer_bytes",
    "Bytes of stream content queued between upstream readers and client writers, all streams.",
    registry=REGISTRY,
)
UPSTREAM_READ_PAUSED = Counter(
    "tokenpipe_upstream_read_paused_seconds",
    "Seconds upstream reads were paused because a client's queue was over its high watermark.",
    registry=REGISTRY,
)


RECOVERY_RECORD_DROPPED = Counter(
    "tokenpipe_recovery_record_dropped",
    "Streams whose recovery record (the text so far, kept to continue a cut stream) passed "
    "its bound (relay/events.py RECORD_MAX_BYTES): recovery is off for the rest of the stream.",
    registry=REGISTRY,
)


LOG_LINES_DROPPED = Counter(
    "tokenpipe_log_lines_dropped",
    "Log lines dropped because stderr did not take them and MAX_LINES waited already "
    "(observe/log_writer.py): the event loop does not wait for a full stderr.",
    registry=REGISTRY,
)


# -- tail-latency control (router/, control/deadline, budget, breaker) ----------------------
RETRIES = Counter(
    "tokenpipe_retries",
    "Upstream requests sent again, by reason (connect, status_5xx, status_429, full, "
    "ttft_deadline, midstream) and by what happened (retried, no_budget, requeued: a full "
    "upstream's refusal waiting for a slot again, outside the budget).",
    ("reason", "outcome"),
    registry=REGISTRY,
)
HEDGES = Counter(
    "tokenpipe_hedges",
    "Hedged first tokens, by outcome: won (the hedge answered first), lost (the first request "
    "did), failed, no_budget (not sent: budget or capacity).",
    ("outcome",),
    registry=REGISTRY,
)
DEADLINE = FastGauge(  # a series per upstream and model: written by hand (exposition.py)
    "tokenpipe_deadline_seconds",
    "Current adaptive deadline by kind (ttft, stall, hedge_delay), per upstream and model.",
    ("kind", *LABELS),
    registry=REGISTRY,
)
UPSTREAM_STATE = FastGauge(
    "tokenpipe_upstream_state",
    "Circuit breaker state per upstream: 0 closed (in service), 1 half-open (probing), "
    "2 open (out for the cool-down).",
    ("upstream",),
    registry=REGISTRY,
)

_index_labels()


class RequestSeries:
    """Every series a request touches for its labels (REQUEST_LABELS: api, upstream, model),
    looked up once per request instead of once per metric (seven `child` calls a request,
    each a tuple and two dict lookups). The status counter's children are looked up on use
    (at most ~500 statuses, bounded by `child`)."""

    __slots__ = ("completion", "duration", "inflight", "itl", "labels", "prompt", "tpot", "ttft")

    def __init__(self, labels: tuple[str, str, str]) -> None:
        self.labels = labels
        self.ttft = child(TTFT, *labels)
        self.itl = child(ITL, *labels)
        self.tpot = child(TPOT, *labels)
        self.duration = child(REQUEST_DURATION, *labels)
        self.inflight = child(INFLIGHT, *labels)
        self.prompt = child(TOKENS, "prompt", *labels)
        self.completion = child(TOKENS, "completion", *labels)

    def requests(self, status: int) -> Any:
        return child(REQUESTS, str(status), *self.labels)


#: RequestSeries by labels. Bound: _CHILDREN_MAX entries (cleared past it, as `_children`;
#: a cleared bundle's children are the same objects once looked up again).
_series: dict[tuple[str, str, str], RequestSeries] = {}


def request_series(api: str, upstream: str, model: str) -> RequestSeries:
    """The series of these labels, the model folded into OTHER unless allowed (as `child`)."""
    key = (api, upstream, model if model in _models else OTHER)
    found = _series.get(key)
    if found is None:
        if len(_series) >= _CHILDREN_MAX:
            _series.clear()
        found = _series[key] = RequestSeries(key)
    return found
