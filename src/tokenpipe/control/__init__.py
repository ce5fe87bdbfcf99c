"""The control layer: how much traffic may pass, and when, decided apart from the wire.

Gates: API keys (`auth`), per-key quotas (`admission`), the per-upstream limiter that waits
for capacity (`limiter`, with `aimd` for concurrency and `bucket` token buckets held in a
`store`, in memory or `redis_backend`), the circuit breaker (`breaker`), the stream's credit
and pace (`flowgate`) and the memory the requests being served hold (`bodies`). Beside
them: retry and hedge budgets (`budget`), deadlines learned from latency quantiles and the
request's one deadline scope (`deadline`, `quantiles`), what a request costs (`cost`,
capped by `published` windows), and the upstream's rate-limit headers and their sane ranges
(`ratelimit_headers`, `bounds`).
`traffic` builds these from settings and gives each request its `Ticket` through them.

The algorithms are small, pure and clock-injected. Layer: below everything of the request
path (front, pipeline, context, router, relay, upstream, dialects); control modules import
only each other, `clock`, `errors`, `settings`, `usage` and `observe` (import-linter checks
it: pyproject.toml).
"""
