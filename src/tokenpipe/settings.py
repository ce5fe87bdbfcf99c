"""The one settings object, read from one YAML file (config_file.py). Every key is documented
in docs/config.md.

msgspec decodes the YAML into typed structs, so a bad config fails at start with an exact path
(`Expected int, got str - at $.server.port`) instead of misbehaving later.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

PositiveFloat = Annotated[float, Meta(gt=0)]
PositiveInt = Annotated[int, Meta(gt=0)]
#: Entries a config's lists and maps may hold. YAML's aliases let a small file name one list
#: many times inside another, and each use is checked (and kept) anew: 2,000 aliases of one
#: upstream with 20,000 models, a 135 KB file, took 12.5 s and 339 MB to refuse, and more
#: would never end. msgspec checks a length before the entries, so these bound what any file
#: can expand to (the two largest multiplied: 10 M names, 3.1 s and 100 MB). Past one: exit 2
#: naming the list.
MAX_UPSTREAMS = 1_000
#: Models an upstream names in a config, and ids kept of an upstream's /v1/models
#: (upstream/http.py says why 10,000).
MAX_MODELS = 10_000
MAX_API_KEYS = 100_000
#: CORS origins, context models, fallback rules and the upstreams of one.
MAX_ENTRIES = 10_000
Port = Annotated[int, Meta(ge=0, le=65535)]


class ServerSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Port = 8000
    #: gRPC front; 0 turns it off.
    grpc_port: Port = 50051
    #: Request bodies larger than this get 413 (bytes).
    max_body_bytes: PositiveInt = 4 * 1024 * 1024
    #: What the bodies of the requests being served may hold in all, estimated (bytes:
    #: 4 a byte of body, 128 a JSON object or array; control/bodies.py). Past it a new request
    #: gets 503 `server_overloaded` with Retry-After. 1 GiB: ~250 bodies of 4 MiB of text.
    max_body_memory_bytes: PositiveInt = 1024 * 1024 * 1024
    #: The share of the event loop one API key's request bodies may take to parse (seconds of
    #: parse per second, estimated from a body's JSON objects and arrays; control/bodies.py).
    #: Past it, after a burst of 0.5 s, the key's bodies of 10,000 objects and arrays or more
    #: get 429 with Retry-After until its share refills; other bodies never do.
    max_parse_share_per_key: Annotated[float, Meta(gt=0, le=1)] = 0.25
    #: On SIGTERM, open streams may finish for this long before the process exits (seconds).
    drain_seconds: Annotated[float, Meta(ge=0)] = 30.0
    #: After SIGTERM, keep answering (readyz 503, API requests 503 + Retry-After) for at least
    #: this long, so probes and load balancers see the 503 (seconds; capped at drain_seconds).
    drain_grace_seconds: Annotated[float, Meta(ge=0)] = 5.0
    #: A client must send its request headers and body within this time (seconds).
    read_timeout_seconds: PositiveFloat = 30.0
    #: A kept-alive client connection is closed once idle this long after its last answer
    #: (seconds). Keep it above the idle timeout of a load balancer in front (AWS's ALB:
    #: 60 s), or the balancer may send a request on a connection the gateway is closing,
    #: and its client gets a 502. A request begun on it has `read_timeout_seconds` again.
    keepalive_seconds: PositiveFloat = 75.0
    #: Kernel send buffer of a streaming client's socket (bytes; 0: the kernel's autotuning,
    #: up to 4 MiB on Linux). Small, so a slow reader is noticed at once and gets merged
    #: events instead of a stale backlog parked in the kernel; tokens need little bandwidth.
    stream_send_buffer_bytes: Annotated[int, Meta(ge=0)] = 16 * 1024
    #: Browser origins allowed to call the API (CORS), e.g. `https://app.example.com`; "*" for
    #: any. Empty (the default): no CORS headers, browsers on other origins are refused.
    cors_origins: Annotated[list[str], Meta(max_length=MAX_ENTRIES)] = msgspec.field(
        default_factory=list
    )
    #: One log line per request (method, path, status, duration, request id) on the
    #: `tokenpipe.access` logger.
    access_log: bool = False


class ApiKey(Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    #: Hex SHA-256 digest of the key. The key itself is never stored.
    sha256: Annotated[str, Meta(pattern="^[0-9a-fA-F]{64}$")]


class AuthSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    api_keys: Annotated[list[ApiKey], Meta(max_length=MAX_API_KEYS)] = msgspec.field(
        default_factory=list
    )


class UpstreamSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    #: Base URL of the upstream's API, with its version path (`http://host:port/v1`).
    url: Annotated[str, Meta(pattern="^https?://")]
    #: The API it speaks: `openai` (chat, completions, responses, embeddings) or `anthropic`
    #: (Messages). On the command line: `--upstream anthropic+https://api.anthropic.com/v1`.
    api: Literal["openai", "anthropic"] = "openai"
    #: How a client's /v1/responses request reaches this `openai` upstream: `native` (passed
    #: through to its /responses), `chat` (translated into a chat completion, for servers
    #: without the Responses API: llama.cpp, the local model, most OpenAI-compatible servers)
    #: or `auto`: the upstream is asked once whether it has /responses (upstream/
    #: responses_probe.py), native if so, else chat.
    responses: Literal["auto", "chat", "native"] = "auto"
    #: The `anthropic-version` header sent to an `anthropic` upstream.
    anthropic_version: str = "2023-06-01"
    #: Name of the environment variable that holds this upstream's API key (never the key itself).
    api_key_env: str | None = None
    #: Models this upstream serves; "*" forwards any model (the upstream's /v1/models is asked).
    models: Annotated[list[str], Meta(max_length=MAX_MODELS)] = msgspec.field(
        default_factory=lambda: ["*"]
    )
    connect_timeout_seconds: PositiveFloat = 5.0
    #: Longest silence on an open upstream response before it is treated as failed (seconds).
    read_timeout_seconds: PositiveFloat = 300.0
    #: Bound on pooled connections to this upstream; requests over it wait for a free one.
    max_connections: PositiveInt = 1024
    #: An idle pooled connection is closed after this long (seconds), but for the
    #: `warm_connections` most recently used: those stay open up to `warm_seconds` (with TCP
    #: keep-alive probes past `keepalive_seconds`), so that a request after a quiet spell
    #: finds a connection and pays no TCP and TLS handshakes. The upstream may close any
    #: sooner (seen, and handled: upstream/reuse.py).
    keepalive_seconds: PositiveFloat = 30.0
    warm_connections: Annotated[int, Meta(ge=0)] = 2
    warm_seconds: PositiveFloat = 300.0
    #: Kernel receive buffer of each upstream connection (bytes; 0: the kernel's autotuning).
    #: It bounds what a paused stream leaves in the kernel: autotuning grows it to
    #: net.ipv4.tcp_rmem's maximum (6-32 MB) on a fast link. 256 KiB (Linux doubles it) still
    #: carries over 2.5 MB/s at a 100 ms round trip, far above any token stream.
    receive_buffer_bytes: Annotated[int, Meta(ge=0)] = 256 * 1024
    #: Ask for `usage` on streams (stream_options.include_usage) so token metrics are exact;
    #: the usage chunk is removed again for clients that did not ask for it.
    request_usage: bool = True
    #: The upstream continues a trailing assistant message (vLLM's `continue_final_message`):
    #: a chat stream cut mid-way elsewhere may continue here (tail.recovery).
    continue_final_message: bool = False

    def api_key(self) -> str | None:
        """The key from the environment, without the blanks around it (a key read from a
        file or a mounted secret often ends with a newline); None when unset or blank."""
        key = os.environ.get(self.api_key_env, "").strip() if self.api_key_env else ""
        return key or None


class ContextModel(Struct, forbid_unknown_fields=True, kw_only=True):
    """Context budgeting for one model (docs/context.md)."""

    #: The model name as clients send it.
    name: str
    #: Context window: prompt plus output (tokens). Unset: from `gguf`, the upstream's
    #: /v1/models, or the built-in table; a model whose window is unknown is never budgeted.
    window: PositiveInt | None = None
    #: History compression for this model: off, truncate or summarize (default: context.policy).
    policy: Literal["off", "truncate", "summarize"] | None = None
    #: How prompt tokens are counted: auto, estimate, tiktoken:ENCODING or gguf:PATH.
    tokenizer: str = "auto"
    #: A GGUF file whose metadata gives the window and whose vocabulary counts tokens exactly
    #: ("local": the packaged Gemma 3 270M of the `local` extra).
    gguf: str | None = None


class ContextSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    """Keeps requests inside the model's context window (docs/context.md)."""

    #: What to do with history that would not fit: off, truncate or summarize. Applied only to
    #: a request that would not fit; a request that fits is never altered.
    policy: Literal["off", "truncate", "summarize"] = "truncate"
    #: Tokens kept free between prompt + max_tokens and the window (counting error, template).
    margin_tokens: Annotated[int, Meta(ge=0)] = 16
    #: Extra share of the prompt kept free while tokens are estimated rather than counted.
    estimate_margin: Annotated[float, Meta(ge=0, le=1)] = 0.05
    #: Output room assumed for a request without max_tokens (tokens).
    reserve_output_tokens: PositiveInt = 512
    #: max_tokens is lowered to what fits only while at least this many (or the client's own
    #: max_tokens, if smaller) remain; below it the history is compressed instead.
    min_output_tokens: PositiveInt = 64
    #: Share of the window's prompt budget a new cut fills. 1.0 drops only what does not fit;
    #: less leaves room for the next turns, which then reuse the same cut (one summary serves
    #: several turns, and upstream prompt caches keep hitting). Unset: 1.0 with truncate,
    #: 0.7 with summarize.
    compress_target: Annotated[float, Meta(gt=0, le=1)] | None = None
    #: Model that writes summaries (default: the request's own model).
    summarizer_model: str | None = None
    #: A summary that takes longer than this falls back to truncation (seconds).
    summary_deadline_seconds: PositiveFloat = 10.0
    #: Longest summary asked for (tokens).
    summary_max_tokens: PositiveInt = 256
    #: Summaries kept, by hash of the history they summarise (least recently used dropped).
    summary_cache_entries: PositiveInt = 1024
    models: Annotated[list[ContextModel], Meta(max_length=MAX_ENTRIES)] = msgspec.field(
        default_factory=list
    )


class RedisSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    url: str = "redis://127.0.0.1:6379/0"
    #: Prefix of every key tokenpipe writes, so several gateways can share one Redis.
    key_prefix: str = "tokenpipe"
    #: A limiter decision that Redis has not answered within this time falls back to the
    #: local share of the limit (seconds).
    timeout_seconds: PositiveFloat = 0.25


class UpstreamLimits(Struct, forbid_unknown_fields=True, kw_only=True):
    """Known limits of one upstream; its response headers correct them as they arrive."""

    rpm: PositiveFloat | None = None
    tpm: PositiveFloat | None = None
    #: Depth of the buckets in seconds of refill (providers' buckets refill over a minute).
    bucket_seconds: PositiveFloat = 60.0
    #: Upper bound of the (adaptive) concurrency limit for this upstream.
    max_concurrency: PositiveInt | None = None


class LimitsSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    #: Where buckets live: this process (`memory`) or shared by all replicas (`redis`).
    backend: Literal["memory", "redis"] = "memory"
    redis: RedisSettings = msgspec.field(default_factory=RedisSettings)
    #: Longest a request waits for upstream capacity before it gets 429 (seconds).
    queue_deadline_seconds: PositiveFloat = 30.0
    #: Bound on requests waiting per upstream; the next one gets 429 at once.
    max_waiting: PositiveInt = 10_000
    #: Learn rate limits from the upstreams' x-ratelimit-* / anthropic-ratelimit-* headers.
    learn_from_headers: bool = True
    #: AIMD concurrency limit per upstream (shrinks on 429/503/504/529, grows with demand).
    adaptive_concurrency: bool = True
    initial_concurrency: PositiveInt = 32
    max_concurrency: PositiveInt = 1024
    #: Output tokens reserved for a request that sets no max_tokens (corrected from usage).
    default_output_tokens: PositiveInt = 256
    #: Most tokens one request may reserve or be charged (prompt + output) when its model's
    #: window is unknown; a known window caps it instead.
    max_request_tokens: PositiveInt = 1_048_576
    #: Gateway processes sharing this config (set by `serve --workers`); with the memory
    #: backend each process enforces 1/workers of every limit.
    workers: PositiveInt = 1
    #: Configured limits by upstream name (optional; headers are learned either way).
    upstreams: dict[str, UpstreamLimits] = msgspec.field(default_factory=dict)


class KeyQuota(Struct, forbid_unknown_fields=True, kw_only=True):
    """Per API key budget; a key over it gets 429 with Retry-After at once."""

    rpm: PositiveFloat | None = None
    tpm: PositiveFloat | None = None
    max_concurrency: PositiveInt | None = None
    #: Depth of the key's buckets in seconds of refill.
    bucket_seconds: PositiveFloat = 60.0


class DeadlineSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    """clamp(k x p-quantile, floor, ceiling) of what this upstream and model did lately;
    `initial` until `min_samples` values were seen (docs/config.md, tail)."""

    k: PositiveFloat = 1.5
    quantile: Annotated[float, Meta(gt=0, lt=1)] = 0.99
    floor_seconds: PositiveFloat = 2.0
    ceiling_seconds: PositiveFloat = 10.0
    initial_seconds: PositiveFloat = 10.0


class RetrySettings(Struct, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    #: Sends per request at most, first one included.
    max_attempts: PositiveInt = 3
    #: Retries allowed per request over the budget window (0.1: at most 10% more requests).
    budget_ratio: Annotated[float, Meta(ge=0)] = 0.1
    #: Retries allowed per window on top of the ratio (so a quiet gateway can still retry).
    budget_reserve: Annotated[float, Meta(ge=0)] = 3.0
    #: Full-jitter exponential backoff before retrying the same upstream (seconds).
    backoff_base_seconds: PositiveFloat = 0.1
    backoff_cap_seconds: PositiveFloat = 2.0
    #: A 429 from the model's only upstream is retried (after the limiter's pause) only when
    #: it asks for at most this long; a longer pause goes back to the client with its
    #: Retry-After. A 429 falls over to another upstream whatever it asks (seconds).
    max_429_wait_seconds: Annotated[float, Meta(ge=0)] = 0.5


class HedgeSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    #: A second request goes out when no first token arrived after this quantile of TTFT.
    quantile: Annotated[float, Meta(gt=0, lt=1)] = 0.95
    #: Hedge delay while the TTFT estimate has fewer than `tail.min_samples` values (seconds).
    initial_delay_seconds: PositiveFloat = 1.0
    #: Shortest hedge delay (seconds).
    min_delay_seconds: Annotated[float, Meta(ge=0)] = 0.01
    #: Hedges allowed per request over the budget window (0.1: at most 10% more requests). A
    #: cap, not a rate: hedges go only to requests slower than the hedge quantile, so the extra
    #: load is about 1 - quantile (5%). At a 5% cap, windows with more stalls than average run
    #: dry and the tail stays (benchmarks/tail.py: p99 TTFT 2.1 s at 0.05, 91 ms at 0.1).
    budget_ratio: Annotated[float, Meta(ge=0)] = 0.1
    budget_reserve: Annotated[float, Meta(ge=0)] = 1.0
    #: A hedge waits at most this long for limiter capacity, else it is not sent (seconds).
    max_queue_seconds: PositiveFloat = 0.05


class RecoverySettings(Struct, forbid_unknown_fields=True, kw_only=True):
    """Mid-stream recovery: a text completion cut after content continues elsewhere."""

    enabled: bool = True
    #: Continuations per request at most.
    max_continuations: PositiveInt = 2


class BreakerSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    #: Failures in a row that take an upstream out.
    failures: PositiveInt = 5
    #: Seconds out before one probe request is let through.
    cooldown_seconds: PositiveFloat = 10.0


class TailSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    """Tail-latency control (docs/config.md, `tail`). On by default."""

    #: Adaptive TTFT and stall deadlines (off: only upstreams[].read_timeout_seconds).
    deadlines: bool = True
    ttft: DeadlineSettings = msgspec.field(default_factory=DeadlineSettings)
    stall: DeadlineSettings = msgspec.field(default_factory=DeadlineSettings)
    #: Whole-request deadline (seconds; unset: none). A client may ask for a shorter one
    #: with the header x-tokenpipe-deadline-seconds.
    total_seconds: PositiveFloat | None = None
    retries: RetrySettings = msgspec.field(default_factory=RetrySettings)
    hedging: HedgeSettings = msgspec.field(default_factory=HedgeSettings)
    recovery: RecoverySettings = msgspec.field(default_factory=RecoverySettings)
    breaker: BreakerSettings = msgspec.field(default_factory=BreakerSettings)
    #: Window of the latency estimates (seconds) and samples before they replace the
    #: static values.
    window_seconds: PositiveFloat = 60.0
    min_samples: PositiveInt = 20
    #: Ordered upstream names per model: the first is tried first, the rest are fallbacks.
    #: Models not named here use every upstream that serves them, in config order.
    fallbacks: Annotated[
        dict[str, Annotated[list[str], Meta(max_length=MAX_ENTRIES)]],
        Meta(max_length=MAX_ENTRIES),
    ] = msgspec.field(default_factory=dict)


class LocalSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    """The embedded model that `serve` runs when no upstream is configured."""

    #: Output cap for a request with no max_tokens (tokens): `tokenpipe local
    #: --default-max-tokens`.
    default_max_tokens: PositiveInt = 256


class TracingSettings(Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenTelemetry (docs/observability.md, "Traces"): where spans go is the standard
    OTEL_* environment variables' business; this says only what goes into them."""

    #: Prompt and completion text in spans (`gen_ai.input.messages`,
    #: `gen_ai.output.messages`). A privacy choice: off, no text ever leaves in a span.
    capture_content: bool = False


class Settings(Struct, forbid_unknown_fields=True, kw_only=True):
    server: ServerSettings = msgspec.field(default_factory=ServerSettings)
    auth: AuthSettings = msgspec.field(default_factory=AuthSettings)
    upstreams: Annotated[list[UpstreamSettings], Meta(max_length=MAX_UPSTREAMS)] = msgspec.field(
        default_factory=list
    )
    limits: LimitsSettings = msgspec.field(default_factory=LimitsSettings)
    #: Quotas by API key name (`auth.api_keys[].name`, or `anonymous` without auth);
    #: the entry "*" applies to every key that has none of its own.
    keys: Annotated[dict[str, KeyQuota], Meta(max_length=MAX_API_KEYS + 2)] = msgspec.field(
        default_factory=dict
    )
    context: ContextSettings = msgspec.field(default_factory=ContextSettings)
    tail: TailSettings = msgspec.field(default_factory=TailSettings)
    local: LocalSettings = msgspec.field(default_factory=LocalSettings)
    tracing: TracingSettings = msgspec.field(default_factory=TracingSettings)
