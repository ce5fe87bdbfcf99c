"""Where bucket state lives: this process (`MemoryStore`) or Redis (`redis_backend`).

A *scope* is one set of buckets: an upstream (`up:NAME`) or an API key (`key:NAME`). Each
scope has a request bucket, a token bucket and a pause (after an upstream 429). The caller
passes the bucket parameters on every call, so what is learned from headers reaches every
replica without a separate sync step.

`share` is the part of every limit this process may use: 1 alone or with Redis, 1/N for N
processes with the memory backend (`serve --workers N`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import isfinite
from typing import NamedTuple, Protocol

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control.bounds import MAX_PAUSE
from tokenpipe.control.bucket import TokenBucket


@dataclass(frozen=True, slots=True)
class Spec:
    """One bucket: refills at `rate` units per second up to `capacity` units."""

    rate: float
    capacity: float

    def scaled(self, share: float) -> Spec:
        return Spec(self.rate * share, max(1.0, self.capacity * share))


@dataclass(frozen=True, slots=True)
class Limits:
    """The buckets of a scope; None means not limited (or not known yet)."""

    requests: Spec | None = None
    tokens: Spec | None = None

    def scaled(self, share: float) -> Limits:
        if share == 1.0:
            return self
        return Limits(
            self.requests.scaled(share) if self.requests else None,
            self.tokens.scaled(share) if self.tokens else None,
        )

    def __bool__(self) -> bool:
        return self.requests is not None or self.tokens is not None


class Decision(NamedTuple):
    #: 0: granted (the reservation is taken); else seconds to wait before asking again.
    wait: float
    #: Requests and tokens reserved in this scope so far, this one included. Headers that
    #: come back for this request are corrected by what was reserved after it.
    seq_requests: float = 0.0
    seq_tokens: float = 0.0
    #: Level of each bucket after the decision (None: not limited), for headers and metrics.
    remaining_requests: float | None = None
    remaining_tokens: float | None = None
    #: Which state answered (a restarted Redis or a fallback starts a new count).
    origin: int = 0


class Store(Protocol):
    async def reserve(self, scope: str, limits: Limits, tokens: float) -> Decision: ...

    async def learn(
        self,
        scope: str,
        limits: Limits,
        remaining_requests: float | None,
        remaining_tokens: float | None,
        since: Decision | None,
    ) -> None:
        """Sets the levels to what the upstream reported when it answered `since`."""
        ...

    async def pause(self, scope: str, seconds: float) -> None: ...

    def give(self, scope: str, limits: Limits, requests: float, tokens: float) -> None:
        """Returns units to the buckets (negative: charges). Never waits; may be deferred."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class _Scope:
    __slots__ = ("fitted", "paused_until", "requests", "seq_requests", "seq_tokens", "tokens")

    def __init__(self) -> None:
        #: The Limits the buckets were last fitted to (a scope's are the same object from one
        #: request to the next until they change: then the buckets are fitted again).
        self.fitted: Limits | None = None
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.seq_requests = 0.0
        self.seq_tokens = 0.0
        self.paused_until = -float("inf")


def _fit(bucket: TokenBucket | None, spec: Spec | None, clock: Clock) -> TokenBucket | None:
    if spec is None:
        return None
    if bucket is None:
        return TokenBucket(spec.rate, spec.capacity, clock)
    if bucket.rate != spec.rate or bucket.capacity != spec.capacity:
        bucket.configure(spec.rate, spec.capacity)
    return bucket


#: Scopes kept per process: upstreams plus API keys. Past it the oldest-created scope is
#: dropped (it restarts full), which only a config with more keys than this would see.
MAX_SCOPES = 100_000


class MemoryStore:
    """Buckets in this process, on an injected clock."""

    origin = 0

    def __init__(self, clock: Clock = MONOTONIC, share: float = 1.0) -> None:
        self.clock = clock
        self.share = share
        self._scopes: dict[str, _Scope] = {}

    def _scope(self, scope: str, limits: Limits) -> _Scope:
        s = self._scopes.get(scope)
        if s is None:
            if len(self._scopes) >= MAX_SCOPES:
                self._scopes.pop(next(iter(self._scopes)))
            s = self._scopes[scope] = _Scope()
        elif s.fitted is limits:
            return s
        s.fitted = limits
        mine = limits.scaled(self.share)
        s.requests = _fit(s.requests, mine.requests, self.clock)
        s.tokens = _fit(s.tokens, mine.tokens, self.clock)
        return s

    def reserve_now(self, scope: str, limits: Limits, tokens: float) -> Decision:
        s = self._scope(scope, limits)
        wait = s.paused_until - self.clock.now()  # (max(): ~700 instructions)
        if wait < 0.0:
            wait = 0.0
        if s.requests is not None and (w := s.requests.wait_for(1.0)) > wait:
            wait = w
        if s.tokens is not None and (w := s.tokens.wait_for(tokens)) > wait:
            wait = w
        if wait == 0.0:  # both admitted just now (wait_for): charged without a second look
            if s.requests is not None:
                s.requests.commit(1.0)
            if s.tokens is not None:
                s.tokens.commit(tokens)
            s.seq_requests += 1.0
            s.seq_tokens += tokens
        return Decision(
            wait,
            s.seq_requests,
            s.seq_tokens,
            s.requests.held if s.requests is not None else None,
            s.tokens.held if s.tokens is not None else None,
            self.origin,
        )

    async def reserve(self, scope: str, limits: Limits, tokens: float) -> Decision:
        return self.reserve_now(scope, limits, tokens)

    def learn_now(
        self,
        scope: str,
        limits: Limits,
        remaining_requests: float | None,
        remaining_tokens: float | None,
        since: Decision | None,
    ) -> None:
        s = self._scope(scope, limits)
        # Only finite levels are believed (bucket.set_level bounds them to the bucket).
        same = since is not None and since.origin == self.origin
        if (
            s.requests is not None
            and remaining_requests is not None
            and isfinite(remaining_requests)
        ):
            after = s.seq_requests - since.seq_requests if same and since else 0.0
            s.requests.set_level(remaining_requests * self.share - after)
        if s.tokens is not None and remaining_tokens is not None and isfinite(remaining_tokens):
            after = s.seq_tokens - since.seq_tokens if same and since else 0.0
            s.tokens.set_level(remaining_tokens * self.share - after)

    async def learn(
        self,
        scope: str,
        limits: Limits,
        remaining_requests: float | None,
        remaining_tokens: float | None,
        since: Decision | None,
    ) -> None:
        self.learn_now(scope, limits, remaining_requests, remaining_tokens, since)

    async def pause(self, scope: str, seconds: float) -> None:
        self.pause_now(scope, seconds)

    def pause_now(self, scope: str, seconds: float) -> None:
        """Holds the scope for `seconds`, at most MAX_PAUSE (NaN: not at all)."""
        seconds = min(seconds, MAX_PAUSE) if seconds > 0 else 0.0
        s = self._scopes.setdefault(scope, _Scope())
        s.paused_until = max(s.paused_until, self.clock.now() + seconds)

    def give(self, scope: str, limits: Limits, requests: float, tokens: float) -> None:
        s = self._scope(scope, limits)
        if s.requests is not None and requests:
            s.requests.give(requests)
        if s.tokens is not None and tokens:
            s.tokens.give(tokens)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass
