"""The race for a stream's first token: the first response is read straight into the
accumulator (so a role chunk reaches the client at once) while a hedge goes out after the
hedge delay (p95 of TTFT) and a retry after the TTFT deadline; whichever stream produces
content first is read on, the others are closed at once, and the winner's events before its
content (a second role chunk) are dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

from tokenpipe.clock import Timeout
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics
from tokenpipe.relay.buffer import Accumulator
from tokenpipe.relay.events import EventParser
from tokenpipe.relay.stream import read_body
from tokenpipe.router.attempt import BROKEN_BYTES, Attempt, Tries, send, until_answered
from tokenpipe.router.route import Route, cancel
from tokenpipe.upstream.h1 import UpstreamResponse


def _late(seconds: float, bound: str) -> GatewayError:
    return GatewayError(
        504,
        f"no first token from the upstream within {bound} of {seconds:.3g} s",
        code="upstream_timeout",
    )


def _hedged(route: Route, outcome: str) -> None:
    """A hedge's outcome (won, lost, failed, no_budget): counted, and on the request's span."""
    metrics.child(metrics.HEDGES, outcome).inc()
    route.req.trace.set("tokenpipe.hedge.outcome", outcome)


def _broke() -> GatewayError:
    return GatewayError(
        502, "the upstream connection broke before the first token", code="upstream_unavailable"
    )


async def first_content(route: Route, parser: EventParser, acc: Accumulator) -> UpstreamResponse:
    """Returns the response to read on, whose events up to its first content are in the
    accumulator already. Raises GatewayError when no stream produced content in time and no
    retry is left."""
    policy, req = route.policy, route.req
    uresp = route.uresp
    hedging = policy.settings.hedging
    name = route.upstream.name
    now = policy.clock.now()
    ttft = policy.ttft_deadline(name, req.model, req.cls)
    # The upstream's fixed read timeout bounds the wait whatever the adaptive deadline; the
    # error names the bound that is hit first.
    read_cap = route.upstream.settings.read_timeout_seconds
    ttft_end = route.sent_at + read_cap
    # The error is built only when it is raised (a GatewayError and its text per request
    # cost ~2% of the request path's CPU when built eagerly: py-spy, 1-token requests).
    late: Callable[[], GatewayError] = partial(_late, read_cap, "the upstream's read timeout")
    if ttft is not None and route.sent_at + ttft < ttft_end:
        ttft_end, late = route.sent_at + ttft, partial(_late, ttft, "the TTFT deadline")
    scope = req.scope
    if scope.at <= ttft_end:
        ttft_end, late = scope.at, partial(scope.error, True)
    client_bound = scope.client and ttft_end == scope.at
    hedge_at = None
    if hedging.enabled:
        hedge_at = route.sent_at + policy.hedge_delay(name, req.model, req.cls)
    # Most first responses bring content before the hedge delay: read inline (no task, no
    # wait set) until the earlier of hedge time and TTFT deadline; the race below starts
    # only when that passes.
    due = ttft_end if hedge_at is None or hedge_at > ttft_end else hedge_at
    timer = Timeout(due - now if due > now else 0.0, acc.task)  # (max(): ~700 instructions)
    try:
        with timer:
            await read_body(uresp, parser, acc, until_first=True)
    except TimeoutError:
        if not timer.expired():
            raise  # not ours: a read timeout below (a TimeoutError too)
    except Exception as e:
        if acc.write_error is not None or isinstance(e, BROKEN_BYTES):
            raise
        return await _primary_broke(route, parser, acc)
    else:
        return _primary_won(route, None)
    primary: asyncio.Task[None] | None = asyncio.create_task(
        read_body(uresp, parser, acc, until_first=True)
    )
    hedge: asyncio.Task[Attempt] | None = None
    hedged: Attempt | None = None  # the hedge's attempt (its span marked when it loses)
    try:
        while True:
            waiting: set[asyncio.Task[Any]] = {t for t in (primary, hedge) if t is not None}
            if not waiting:
                return await _retry(route, parser, acc, "ttft_deadline", late())
            now = policy.clock.now()
            due = ttft_end if hedge_at is None else min(hedge_at, ttft_end)
            done, _ = await asyncio.wait(
                waiting, timeout=max(0.0, due - now), return_when=asyncio.FIRST_COMPLETED
            )
            now = policy.clock.now()
            if primary in done:
                primary_task, primary = primary, None
                exc = primary_task.exception()
                if exc is None:
                    if hedge is not None and hedged is not None:
                        hedged.span.mark("lost")  # cancelled below
                    return _primary_won(route, hedge)
                if acc.write_error is not None or isinstance(exc, BROKEN_BYTES):
                    raise exc  # the client went away, or the upstream's bytes are broken
                if hedge is None:
                    return await _primary_broke(route, parser, acc)
                policy.unhealthy(name)  # broke before any content
                route.span.mark("broken")
                route.ticket.failed(502)
            if hedge is not None and hedge in done:
                a = hedge.result()
                hedge = None
                if a.streaming:
                    _hedged(route, "won")
                    a.span.mark("won")
                    if primary is not None:
                        route.span.mark("lost")
                        try:
                            await cancel(primary)
                        except BaseException:  # the client left meanwhile
                            a.discard(None)
                            raise
                        primary = None
                        # Censored: its TTFT is longer than we saw (see Policy.hedge_delay).
                        policy.censored(name, req.model, req.cls)
                        route.ticket.failed(499)
                    return route.switch(a, parser, acc)
                _hedged(route, "no_budget" if a.fatal else "failed")
                if a.resp is not None or a.fatal is None:
                    a.discard(a.resp.status if a.resp is not None else 502)
                if primary is None:
                    return await _retry(
                        route, parser, acc, a.reason or "connect", a.error or _broke()
                    )
                continue
            if done:
                continue
            if now >= ttft_end and client_bound:
                # The client's own deadline: the upstream is not to blame (no breaker
                # failure, no concurrency drop, no censored TTFT) and no time is left.
                for t in (primary, hedge):
                    if t is not None:
                        t.cancel()
                route.span.mark("deadline")
                route.ticket.failed(None)
                raise late()
            if now >= ttft_end:
                # No content from anyone in time: close all, then retry.
                route.span.mark("ttft_deadline")
                if hedge is not None and hedged is not None:
                    hedged.span.mark("ttft_deadline")
                if primary is not None:
                    await cancel(primary)
                    primary = None
                    uresp.close()  # at once: the stalled upstream stops generating for it
                    route.ticket.failed(504)
                    policy.censored(name, req.model, req.cls)
                if hedge is not None:
                    await cancel(hedge)
                    hedge = None
                policy.unhealthy(name)
                return await _retry(route, parser, acc, "ttft_deadline", late())
            if hedge_at is not None and now >= hedge_at:
                hedge_at = None
                attempt = hedged = await _hedge(route)
                if attempt is not None:
                    hedge = asyncio.create_task(
                        send(
                            policy,
                            attempt,
                            req,
                            req.body,
                            first_token=True,
                            deadline=max(0.001, ttft_end - now),
                        )
                    )
    finally:
        # Whatever happens (our own cancellation included), no attempt outlives this: all
        # are cancelled before any is awaited.
        left = [t for t in (primary, hedge) if t is not None]
        for t in left:
            t.cancel()
        try:
            for t in left:
                await cancel(t)
        finally:
            if hedge is not None:
                _drop_unused(hedge, route.responses)


def _primary_won(route: Route, hedge: asyncio.Task[Attempt] | None) -> UpstreamResponse:
    """The first response produced content (or ended) first: it is read on."""
    policy, req = route.policy, route.req
    policy.ttft_estimate(route.upstream.name, req.model, req.cls).add(
        policy.clock.now() - route.sent_at
    )
    policy.healthy(route.upstream.name)
    route.span.event("first_token")
    if hedge is not None:
        _hedged(route, "lost")
        route.span.mark("won")
    return route.uresp


async def _primary_broke(route: Route, parser: EventParser, acc: Accumulator) -> UpstreamResponse:
    """The first response broke before any content and no hedge is out: retry."""
    route.policy.unhealthy(route.upstream.name)
    route.span.mark("broken")
    route.ticket.failed(502)
    return await _retry(route, parser, acc, "connect", _broke())


async def _hedge(route: Route) -> Attempt | None:
    """A second attempt for a request with no first token yet, if the budget allows."""
    policy = route.policy
    if not policy.hedge_budget.try_spend():
        _hedged(route, "no_budget")
        return None
    req = route.req
    target = policy.pick(await policy.order(req.model, req.dialect.api), avoid=route.upstream.name)
    if target is None:
        _hedged(route, "no_budget")
        return None
    side = route.side_ticket()
    side.deadline = min(
        side.deadline, policy.clock.now() + policy.settings.hedging.max_queue_seconds
    )
    return Attempt(target, side, hedge=True)


async def _retry(
    route: Route, parser: EventParser, acc: Accumulator, reason: str, error: GatewayError
) -> UpstreamResponse:
    """Sends again (the one retry loop) until a stream produces content; raises the last
    error when none is left."""
    a = await until_answered(
        route.policy,
        route.req,
        Tries(route.policy.send_limit(), used=1),
        body=route.req.body,
        first_token=True,
        ticket=route.side_ticket,
        avoid=route.upstream.name,
        reason=reason,
    )
    if a is not None and a.streaming:
        return route.switch(a, parser, acc)
    if a is not None:  # the last failure (or an answer that is not a stream) is the error
        error = a.failure()
        a.discard(a.resp.status if a.resp is not None else None)
    try:
        raise error
    finally:  # the error's traceback holds this frame: its locals must not hold the error
        del a, error


def _drop_unused(task: asyncio.Task[Attempt], used: list[UpstreamResponse]) -> None:
    """A hedge that finished in the same step as the primary won (or as we were cancelled)
    holds an open response nobody reads: closed here, else it streams on upstream."""
    if not task.done() or task.cancelled() or task.exception() is not None:
        return
    a = task.result()
    if a.resp is not None and a.resp not in used:
        a.discard(None)
