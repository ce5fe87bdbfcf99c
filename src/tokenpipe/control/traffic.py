"""Builds the traffic controls from settings and follows one request through them.

`TrafficControl` owns the store (memory or Redis), one `Limiter` per upstream and the
per-key `Admission`. A `Ticket` is one request's passage: admitted for its key, then a
permit from the limiter of each upstream it is sent to, released when the request ends.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control import cost as cost_mod
from tokenpipe.control.admission import Admission, Grant
from tokenpipe.control.aimd import AIMDLimit
from tokenpipe.control.deadline import UNBOUNDED, Scope
from tokenpipe.control.limiter import Limiter, Permit
from tokenpipe.control.published import known_window
from tokenpipe.control.store import Limits, MemoryStore, Spec, Store
from tokenpipe.errors import GatewayError
from tokenpipe.settings import Settings, UpstreamLimits

log = logging.getLogger("tokenpipe.limits")

#: Statuses of a failed send that mean the request never reached the upstream.
NOT_SENT = frozenset({502})


def _configured(u: UpstreamLimits | None) -> Limits:
    if u is None:
        return Limits()

    def spec(per_minute: float | None) -> Spec | None:
        if per_minute is None:
            return None
        rate = per_minute / 60.0
        return Spec(rate, max(1.0, rate * u.bucket_seconds))

    return Limits(spec(u.rpm), spec(u.tpm))


#: The limiter queue key of the gateway's own calls (fair-queued like one more client).
INTERNAL_KEY = "tokenpipe-internal"


class TrafficControl:
    def __init__(self, settings: Settings, clock: Clock = MONOTONIC) -> None:
        lim = settings.limits
        self.settings = lim
        self.clock = clock
        share = 1.0 / lim.workers
        self.store: Store
        if lim.backend == "redis":
            from tokenpipe.control.redis_backend import RedisStore

            self.store = RedisStore(
                lim.redis.url,
                prefix=lim.redis.key_prefix,
                timeout=lim.redis.timeout_seconds,
                clock=clock,
            )
        else:
            self.store = MemoryStore(clock, share=share)
        self.limiters: dict[str, Limiter] = {}
        for u in settings.upstreams:
            conf = lim.upstreams.get(u.name)
            ceiling = conf.max_concurrency if conf and conf.max_concurrency else lim.max_concurrency
            ceiling = max(1, int(ceiling * share))
            if lim.adaptive_concurrency:
                conc = AIMDLimit(
                    min(lim.initial_concurrency, ceiling),
                    maximum=ceiling,
                    clock=clock,
                    slow_start=True,  # a cold burst is not paced by additive increase
                )
            else:
                conc = AIMDLimit(ceiling, minimum=ceiling, maximum=ceiling, clock=clock)
            self.limiters[u.name] = Limiter(
                u.name,
                self.store,
                configured=_configured(conf),
                learn=lim.learn_from_headers,
                concurrency=conc,
                clock=clock,
                max_waiting=lim.max_waiting,
            )
        self.admission = Admission(settings.keys, self.store, share)
        unknown = sorted(set(lim.upstreams) - set(self.limiters))
        if unknown:
            log.warning("limits.upstreams names no configured upstream: %s", ", ".join(unknown))

    def cost(self, request: dict[str, Any], output: bool = True) -> cost_mod.Cost:
        """The request's cost, capped at its model's published window, else at
        `limits.max_request_tokens` (a window learned from the upstream has already lowered
        max_tokens in the context hop). 400 for a max_tokens no model could run. `output`:
        the request generates tokens (an embedding request does not: none are reserved)."""
        model = request.get("model")
        window = known_window(model) if isinstance(model, str) else None
        cap = window or self.settings.max_request_tokens
        default = self.settings.default_output_tokens if output else 0
        return cost_mod.of_request(request, default, cap, output=output)

    async def admit(
        self, key: str, request: dict[str, Any], scope: Scope = UNBOUNDED, output: bool = True
    ) -> Ticket:
        """Per-key quota check (429 when over), then a ticket for the upstream limiters."""
        c = self.cost(request, output)
        grant = await self.admission.admit(key, c.tokens, c.output_param)
        return Ticket(self, key, c, grant, scope)

    def internal(self, request: dict[str, Any]) -> Ticket:
        """A ticket for the gateway's own upstream calls (context summaries): they spend the
        upstream's rate limits like any request, but no client's quota."""
        return Ticket(self, INTERNAL_KEY, self.cost(request), None)

    async def start(self) -> None:
        await self.store.start()

    async def close(self) -> None:
        for limiter in self.limiters.values():
            await limiter.close()
        await self.store.close()


class Ticket:
    """One request's passage. `finish()` may be called more than once (only the first counts)."""

    __slots__ = ("cost", "deadline", "grant", "key", "permit", "scope", "status", "traffic")

    def __init__(
        self,
        traffic: TrafficControl,
        key: str,
        cost: cost_mod.Cost,
        grant: Grant | None,
        scope: Scope = UNBOUNDED,
    ) -> None:
        self.traffic = traffic
        self.key = key
        self.cost = cost
        self.grant = grant
        self.permit: Permit | None = None
        self.status: int | None = None
        #: The request's deadline scope: a wait in the queue ends with it, whatever is left
        #: of the queue's own deadline (`limits.queue_deadline_seconds`, `deadline`).
        self.scope = scope
        self.deadline = traffic.clock.now() + traffic.settings.queue_deadline_seconds

    async def acquire(self, upstream: str, front: bool = False) -> None:
        """Waits for capacity at `upstream`: 429 past the queue deadline, the scope's 504 when
        the request's own deadline ends the wait first. `front`: at the head of the queue (a
        request the full upstream refused, waiting again: `arrived`)."""
        self._release(None, sent=False)  # a permit from an earlier upstream was not used
        limiter = self.traffic.limiters.get(upstream)
        if limiter is None:
            return
        left = self.deadline - self.traffic.clock.now()
        scope = self.scope
        scoped = scope.left() < left
        if scoped:
            left = scope.left()
        try:
            left = left if left > 0.001 else 0.001  # (max(): ~700 instructions)
            self.permit = await limiter.acquire(self.key, self.cost.tokens, left, front)
        except GatewayError as e:
            if scoped and e.status == 429 and scope.passed():
                raise scope.error(True, "queued for upstream capacity") from None
            raise

    async def arrived(self, status: int, headers: Mapping[str, str], private: bool = False) -> bool:
        """The upstream answered (headers only): learn from them. True: it refused because it
        is full (Limiter.observe), and the request may wait for a slot again. `private`: it
        answered from this machine or a private network."""
        self.status = status
        if self.permit is None:
            return False
        return await self.permit.limiter.observe(self.permit, status, headers, private)

    def failed(self, status: int | None) -> None:
        """Sending failed before any answer: 502 never reached it, 504 may have. None: it
        ended for a reason that says nothing about the upstream (the client's own deadline
        or its disconnect): released without a sample for the concurrency limit."""
        self.status = status
        self._release(None, sent=status not in NOT_SENT)

    def _release(self, usage: dict[str, Any] | None, sent: bool) -> None:
        p = self.permit
        if p is None:
            return
        self.permit = None
        charged = self.cost.charged(usage) if sent else None
        p.limiter.release(p, self.status, sent=sent, charged_tokens=charged)

    def finish(self, usage: dict[str, Any] | None = None, status: int | None = None) -> None:
        """The request ended (`status`: what the client got, when it says more, e.g. a 504
        stall mid-stream). The permit and the key's slot are released whatever the other
        raises. `usage`: the upstream's, already checked (`usage.clean`: every caller has
        cleaned it for its own books first)."""
        if status in (503, 504):
            self.status = status
        grant, self.grant = self.grant, None
        try:
            self._release(usage, sent=True)
        finally:
            if grant is not None:
                charged = None
                try:
                    # A key is charged what it used; the upstream's bucket (above) what the
                    # provider counts (max_tokens). Its reservation was capped either way.
                    charged = self.cost.used(usage)
                finally:
                    grant.finish(charged)
