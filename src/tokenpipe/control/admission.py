"""Per-key quotas: requests per minute, tokens per minute and requests in flight.

A key over its budget is turned away at once with an OpenAI-shaped 429, `Retry-After` (when
the budget allows the request again) and `x-ratelimit-*` headers describing the key's own
budget, as providers do: the client's SDK then waits exactly as long as needed. (Waiting in
the gateway is for upstream capacity, which the client cannot see; a key's quota it can.)

A request that could never fit its key's token bucket (its reservation, capped at the
model's window, exceeds the bucket's whole depth) is refused at once with a 400 naming the
field to lower: admitted as debt it would lock the key out for as long as the debt lasts.

Rate quotas live in the same `Store` as the upstream buckets (scope `key:NAME`), so with the
Redis backend they hold across replicas. The concurrency quota is counted per process and
split evenly across `serve --workers` (a count in Redis would leak on a crash).
"""

from __future__ import annotations

import math

from tokenpipe.control.ratelimit_headers import rate_headers
from tokenpipe.control.store import Decision, Limits, Spec, Store
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics
from tokenpipe.settings import KeyQuota


def quota_limits(q: KeyQuota) -> Limits:
    def spec(per_minute: float | None) -> Spec | None:
        if per_minute is None:
            return None
        rate = per_minute / 60.0
        return Spec(rate, max(1.0, rate * q.bucket_seconds))

    return Limits(spec(q.rpm), spec(q.tpm))


class Grant:
    """One admitted request; `finish()` gives back its concurrency slot and corrects tokens."""

    __slots__ = ("admission", "done", "key", "limits", "tokens")

    def __init__(self, admission: Admission, key: str, limits: Limits, tokens: float) -> None:
        self.admission = admission
        self.key = key
        self.limits = limits
        self.tokens = tokens  # reserved
        self.done = False

    def finish(self, charged_tokens: float | None) -> None:
        if self.done:
            return
        self.done = True
        a = self.admission
        a.inflight[self.key] = a.inflight.get(self.key, 1) - 1
        if a.inflight[self.key] <= 0:
            del a.inflight[self.key]
        if charged_tokens is not None and self.limits.tokens is not None:
            a.store.give(f"key:{self.key}", self.limits, 0.0, self.tokens - charged_tokens)


class Admission:
    def __init__(self, quotas: dict[str, KeyQuota], store: Store, share: float = 1.0) -> None:
        self.quotas = quotas
        self.store = store
        self.share = share  # this process's part of each concurrency quota
        self.inflight: dict[str, int] = {}  # bounded by the number of configured keys
        self._limits = {name: quota_limits(q) for name, q in quotas.items()}

    def _quota(self, key: str) -> tuple[KeyQuota, Limits] | None:
        name = key if key in self.quotas else "*" if "*" in self.quotas else None
        if name is None:
            return None
        return self.quotas[name], self._limits[name]

    async def admit(self, key: str, tokens: float, param: str = "max_tokens") -> Grant | None:
        """Admits or raises 429 (400 when `tokens` exceed the key's whole token budget;
        `param` names the field that sets them). None: the key has no quota."""
        found = self._quota(key)
        if found is None:
            return None
        quota, limits = found
        if limits.tokens is not None and tokens > limits.tokens.capacity:
            metrics.ADMISSION_REJECTED.labels("too_large").inc()
            raise GatewayError(
                400,
                f"This request may use up to {tokens:.0f} tokens (prompt estimate plus "
                f"'{param}'), more than this API key's whole token budget "
                f"({limits.tokens.capacity:.0f} tokens); lower '{param}'.",
                code="invalid_value",
                param=param,
            )
        if quota.max_concurrency is not None:
            allowed = max(1, math.floor(quota.max_concurrency * self.share))
            if self.inflight.get(key, 0) >= allowed:
                metrics.ADMISSION_REJECTED.labels("concurrency").inc()
                raise GatewayError(
                    429,
                    f"Too many concurrent requests for this API key (limit {allowed}).",
                    code="rate_limit_exceeded",
                    retry_after=1.0,
                )
        if limits:
            d = await self.store.reserve(f"key:{key}", limits, tokens)
            if d.wait > 0:
                what = "tokens per minute" if _tokens_bound(limits, d, tokens) else "requests"
                metrics.ADMISSION_REJECTED.labels("tpm" if what.startswith("t") else "rpm").inc()
                wait = d.wait if math.isfinite(d.wait) else 60.0
                raise GatewayError(
                    429,
                    f"Rate limit reached for this API key ({what}). "
                    f"Please try again in {wait:.3g} s.",
                    code="rate_limit_exceeded",
                    headers=rate_headers(limits, d),
                    retry_after=wait,
                )
        self.inflight[key] = self.inflight.get(key, 0) + 1
        return Grant(self, key, limits, tokens)


def _tokens_bound(limits: Limits, d: Decision, tokens: float) -> bool:
    """True when the token bucket (not the request bucket) is what holds the request back."""
    if limits.tokens is None or d.remaining_tokens is None:
        return False
    return d.remaining_tokens < min(tokens, limits.tokens.capacity)
