"""The control layer: how much traffic may pass, and when, decided apart from the wire.

Gates: per-key quotas (`admission`), the per-upstream limiter that waits for capacity
(`limiter`, with `aimd` for concurrency and `bucket` token buckets held in a `store`, in
memory or `redis_backend`), the circuit breaker (`breaker`) and the stream's credit and
pace (`flowgate`). Beside them: retry and hedge budgets (`budget`), deadlines learned from
latency quantiles (`deadline`, `quantiles`), what a request costs (`cost`), and the
upstream's rate-limit headers and their sane ranges (`ratelimit_headers`, `bounds`).
`traffic` builds these from settings and gives each request its `Ticket` through them.

The algorithms are small, pure and clock-injected. Imports: besides each other, control
modules use only `clock`, `errors`, `settings`, `usage` and `observe.metrics`, with one
exception: `traffic` takes `known_window` from `context.windows` (a layer above, which in
turn imports `upstream.http`). Nothing is imported here.
"""
