"""What the router knows and decides about upstreams, as plain state with a clock: latency
estimates and the deadlines and hedge delay drawn from them, the circuit breakers, the retry
and hedge budgets, and the order upstreams are tried in. No I/O here: the attempt, race and
resume modules ask it."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control.breaker import CLOSED, OPEN, CircuitBreaker, State
from tokenpipe.control.budget import RatioBudget
from tokenpipe.control.deadline import AdaptiveDeadline
from tokenpipe.control.quantiles import RollingQuantiles
from tokenpipe.dialects import Dialect
from tokenpipe.observe import metrics
from tokenpipe.router.candidates import Router
from tokenpipe.settings import DeadlineSettings, TailSettings
from tokenpipe.upstream.http import HttpUpstream

log = logging.getLogger("tokenpipe.tail")

#: Estimators kept per table; the least recently created is dropped past this (bounds memory
#: when clients send many model names).
MAX_ESTIMATORS = 4096
#: The hedge delay's key in a TTFT estimate's memo (the deadlines' keys are their rules).
_HEDGE = "hedge_delay"


def _rule(d: DeadlineSettings, min_samples: int) -> AdaptiveDeadline:
    return AdaptiveDeadline(
        k=d.k,
        quantile=d.quantile,
        floor=d.floor_seconds,
        ceiling=d.ceiling_seconds,
        initial=d.initial_seconds,
        min_samples=min_samples,
    )


def _show_deadline(kind: str, key: Any, value: float) -> None:
    """The deadline gauge of `kind` for an estimate's (upstream, model, ...) `key`."""
    metrics.child(metrics.DEADLINE, kind, key[0], key[1]).set(value)


def _show_state(upstream: str, state: State) -> None:
    """The circuit state gauge of `upstream`, set as its breaker changes state."""
    metrics.UPSTREAM_STATE.labels(upstream).set(int(state))


def prompt_class(tokens: int) -> int:
    """Prompt size class for TTFT estimates: prefill time grows with the prompt, so a 30k-token
    prompt is not judged by what 100-token prompts do. Classes: <1k, <4k, <16k, more."""
    if tokens < 1024:
        return 0
    return min(3, 1 + int(math.log(tokens / 1024, 4)))


class Policy:
    def __init__(
        self,
        settings: TailSettings,
        router: Router,
        clock: Clock = MONOTONIC,
        defer: Callable[[Callable[[], None]], Any] | None = None,
    ) -> None:
        """`defer`: runs the estimates' stale views' refreshes later (the gateway passes the
        event loop's `call_soon`: see control/quantiles.py); None: at once, on the read."""
        self.settings = settings
        self.router = router
        self.clock = clock
        self._defer = defer
        self.ttft_rule = _rule(settings.ttft, settings.min_samples)
        self.stall_rule = _rule(settings.stall, settings.min_samples)
        r, h = settings.retries, settings.hedging
        self.retry_budget = RatioBudget(r.budget_ratio, r.budget_reserve, clock=clock)
        self.hedge_budget = RatioBudget(h.budget_ratio, h.budget_reserve, clock=clock)
        b = settings.breaker
        self.breakers = {
            u.name: CircuitBreaker(
                b.failures, b.cooldown_seconds, clock, partial(_show_state, u.name)
            )
            for u in router.upstreams
        }
        for name in self.breakers:
            _show_state(name, CLOSED)
        # (upstream, model, prompt class) -> TTFT; (upstream, model) -> gaps between reads.
        self._ttft: dict[tuple[str, str, int], RollingQuantiles] = {}
        self._gap: dict[tuple[str, str], RollingQuantiles] = {}
        # (upstream, model, prompt class) -> first tokens that never came (only counted).
        self._censored: dict[tuple[str, str, int], RollingQuantiles] = {}
        # How each value is drawn from an estimate's view, its gauge set as it is: once a
        # refresh (0.25 s), not on each of a request's three reads (bound once: a method
        # read off the instance is a new object each time).
        self._draw_ttft = self._drawn_ttft
        self._draw_stall = self._drawn_stall
        self._draw_hedge = self._drawn_hedge
        # Dialect class -> some upstream continues its cut streams (upstreams are fixed by
        # config). Bound: the dialect classes.
        self._continues: dict[type[Dialect], bool] = {}

    # -- estimates and deadlines ------------------------------------------------------------

    def _est(self, table: dict[Any, RollingQuantiles], key: Any) -> RollingQuantiles:
        est = table.get(key)
        if est is None:
            if len(table) >= MAX_ESTIMATORS:
                del table[next(iter(table))]
            est = table[key] = RollingQuantiles(
                self.settings.window_seconds, clock=self.clock, defer=self._defer, key=key
            )
        return est

    def ttft_estimate(self, upstream: str, model: str, cls: int) -> RollingQuantiles:
        key = (upstream, model, cls)
        return self._ttft.get(key) or self._est(self._ttft, key)

    def gap_estimate(self, upstream: str, model: str) -> RollingQuantiles:
        key = (upstream, model)
        return self._gap.get(key) or self._est(self._gap, key)

    # The three below run per request: each reads its estimate's memo directly (one call,
    # `derived`), not through `ttft_estimate` and `AdaptiveDeadline.value` (three more).
    # A value is drawn (`_drawn_*`) when the estimate's view is refreshed, and the deadline
    # gauge is set then: it changes only then.

    def ttft_deadline(self, upstream: str, model: str, cls: int) -> float | None:
        if not self.settings.deadlines:
            return None
        key = (upstream, model, cls)
        est = self._ttft.get(key) or self._est(self._ttft, key)
        return est.derived(self.ttft_rule, self._draw_ttft)

    def stall_deadline(self, upstream: str, model: str) -> float | None:
        if not self.settings.deadlines:
            return None
        key = (upstream, model)
        est = self._gap.get(key) or self._est(self._gap, key)
        return est.derived(self.stall_rule, self._draw_stall)

    def censored(self, upstream: str, model: str, cls: int) -> None:
        """A first token that never came (the attempt lost to a hedge or hit the deadline):
        its TTFT is only known to be longer than everything seen."""
        self._est(self._censored, (upstream, model, cls)).add(1.0)

    def hedge_delay(self, upstream: str, model: str, cls: int) -> float:
        """The hedging quantile of TTFT, stalls included (Dean and Barroso: hedge after the
        95th percentile of expected latency). Kept in the TTFT estimate's memo until its view
        is refreshed (0.25 s), as the deadlines are; the censored count is read then."""
        key = (upstream, model, cls)
        est = self._ttft.get(key) or self._est(self._ttft, key)
        return est.derived(_HEDGE, self._draw_hedge)

    def _drawn_ttft(self, est: RollingQuantiles) -> float:
        value = self.ttft_rule.of(est)
        _show_deadline("ttft", est.key, value)
        return value

    def _drawn_stall(self, est: RollingQuantiles) -> float:
        value = self.stall_rule.of(est)
        _show_deadline("stall", est.key, value)
        return value

    def _drawn_hedge(self, est: RollingQuantiles) -> float:
        """Stalls cut short have no TTFT, only a lower bound, so they count as above every
        TTFT seen: with c censored among n requests the q-quantile of all is the
        q x n / (n - c) quantile of the completed ones. Leaving them out would put the delay
        inside ordinary latency and hedge ~5% of ordinary requests; recording their wait as a
        TTFT would drag the delay up to the stalls themselves."""
        h = self.settings.hedging
        q = None
        n = est.count
        if n >= self.settings.min_samples:
            cut = self._est(self._censored, est.key).count
            q = est.quantile(min(1.0, h.quantile * (n + cut) / n))
        value = h.initial_delay_seconds if q is None else max(h.min_delay_seconds, q)
        _show_deadline("hedge_delay", est.key, value)
        return value

    def continues(self, dialect: Dialect) -> bool:
        """Some upstream continues a cut stream of `dialect`'s API (`continues_on`)."""
        found = self._continues.get(type(dialect))
        if found is None:
            found = any(dialect.continues_on(u.settings) for u in self.router.upstreams)
            self._continues[type(dialect)] = found
        return found

    def send_limit(self) -> int:
        """Sends per request, the first included (`tail.retries`)."""
        r = self.settings.retries
        return r.max_attempts if r.enabled else 1

    # -- upstream choice and health ----------------------------------------------------------

    async def order(self, model: str, api: str = "openai") -> list[HttpUpstream]:
        """The upstreams speaking `api` that serve `model`, in `tail.fallbacks` order (else
        config order)."""
        return self.arrange(model, await self.router.candidates(model, api))

    def arrange(self, model: str, candidates: list[HttpUpstream]) -> list[HttpUpstream]:
        """`candidates` (the router's, in config order) in `tail.fallbacks` order."""
        names = self.settings.fallbacks.get(model)
        if not names:
            return candidates
        by_name = {u.name: u for u in candidates}
        return [by_name[n] for n in names if n in by_name] or candidates

    def pick(self, order: list[HttpUpstream], avoid: str | None = None) -> HttpUpstream | None:
        """The first upstream in order whose circuit lets a request through; `avoid` (the one
        that just failed) goes last. When every circuit is open the first is used anyway: the
        breaker reroutes, it never turns away a request no other upstream could serve (one
        client's failing requests must not take a single-upstream gateway down; the retry
        budget keeps the load on a failing upstream bounded)."""
        if avoid is not None:
            order = [u for u in order if u.name != avoid] + [u for u in order if u.name == avoid]
        for u in order:
            if not self.settings.breaker.enabled or self.breakers[u.name].allow():
                return u
        return order[0] if order else None

    def healthy(self, name: str) -> None:
        self.breakers[name].success()

    def unhealthy(self, name: str) -> None:
        b = self.breakers[name]
        was = b.state
        b.failure()
        if b.state is OPEN and was is not OPEN:
            log.warning("upstream %s taken out for %.1f s (circuit open)", name, b.cooldown)

    def upstream_state(self, name: str) -> State:
        return self.breakers[name].state

    def may_retry(self, used: int, limit: int, reason: str, label: str | None = None) -> bool:
        """Another send is allowed: `used` of `limit` sends made, and the retry budget has
        room (counted under `label`, default the reason: tokenpipe_retries_total)."""
        label = label or reason
        if used >= limit:
            return False
        if not self.retry_budget.try_spend():
            metrics.RETRIES.labels(label, "no_budget").inc()
            return False
        metrics.RETRIES.labels(label, "retried").inc()
        return True


def retry_after(headers: Mapping[str, str]) -> float:
    """Seconds a 429 asks us to wait (retry-after-ms or retry-after; 0 when absent)."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is not None:
            try:
                return float(raw) * scale
            except ValueError:
                return 0.0
    return 0.0
