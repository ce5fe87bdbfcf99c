"""One send to one upstream, up to its first token or its headers, and the one retry loop
that every path sends through: the request's first send, the retry after a TTFT deadline or a
broken first response, and the continuation of a cut stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tokenpipe import sse
from tokenpipe.clock import Timeout
from tokenpipe.control.budget import backoff
from tokenpipe.control.deadline import Scope
from tokenpipe.control.traffic import Ticket
from tokenpipe.dialects import Dialect
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics, tracing
from tokenpipe.router.policy import Policy, prompt_class, retry_after
from tokenpipe.upstream.errors import UpstreamError, UpstreamProtocolError
from tokenpipe.upstream.h1 import UpstreamResponse
from tokenpipe.upstream.http import PROTOCOL_ERROR, HttpUpstream

#: Bytes an attempt may read before its first content token (role chunks, comments); past
#: it the attempt counts as answered and the relay takes over (bounds the prefix buffer).
PREFIX_LIMIT = 64 * 1024
#: The upstream's bytes are broken (SSE/JSON, HTTP/1.1 framing): reported, never retried.
BROKEN_BYTES = (sse.SSEProtocolError, UpstreamProtocolError)
#: Times one request may wait for a slot again after a full upstream refused it (reason
#: "full": a 503/529 while it holds accepted streams, Limiter.observe). Each wait lasts until
#: the limiter, its limit cut to what the upstream holds, sees a slot free (a stream end),
#: so these sends do not spend the retry budget; past the bound a refusal is retried as any
#: 5xx (the budget decides), which bounds what a shared upstream that stays full is sent.
MAX_REQUEUES = 8


class Request:
    """What every send of one request shares: the model, its API, the request as sent (`obj`,
    `body`), its id, the pace the client asked for, its deadline scope and its trace (the
    parent of each send's spans; tracing.OFF: none)."""

    __slots__ = (
        "body",
        "cls",
        "dialect",
        "model",
        "obj",
        "pace",
        "request_id",
        "scope",
        "stream",
        "trace",
        "upstreams",
    )

    def __init__(
        self,
        model: str,
        dialect: Dialect,
        obj: dict[str, Any],
        body: bytes,
        request_id: str,
        scope: Scope,
        *,
        stream: bool,
        prompt_tokens: int = 0,
        pace: float | None = None,
        trace: tracing.RequestTrace = tracing.OFF,
        upstreams: list[HttpUpstream] | None = None,
    ) -> None:
        self.model = model
        self.dialect = dialect
        self.obj = obj
        self.body = body
        self.request_id = request_id
        self.scope = scope
        self.stream = stream
        self.pace = pace
        self.cls = prompt_class(prompt_tokens)
        self.trace = trace
        #: The router's candidates as the request was prepared (None: not asked then): the
        #: first send's, not asked again microseconds later; every later send asks.
        self.upstreams = upstreams


class Attempt:
    """One send to one upstream, up to its first content token (streams) or its headers.
    `role` (first, retry, hedge, continuation) and `span` are its trace's (tracing.NO_SPAN
    when untraced); the span ends when the attempt is discarded, or with the route that
    reads it (router/route.py)."""

    __slots__ = (
        "error",
        "fatal",
        "first_at",
        "hedge",
        "prefix",
        "reason",
        "resp",
        "role",
        "sent_at",
        "span",
        "ticket",
        "upstream",
    )

    def __init__(
        self, upstream: HttpUpstream, ticket: Ticket, hedge: bool = False, role: str = "first"
    ) -> None:
        self.upstream = upstream
        self.ticket = ticket
        self.hedge = hedge
        self.role = "hedge" if hedge else role
        self.span: tracing.Span = tracing.NO_SPAN
        self.resp: UpstreamResponse | None = None
        self.prefix: list[bytes] = []  # bytes read while waiting for the first token
        self.sent_at: float | None = None
        self.first_at: float | None = None
        self.error: GatewayError | None = None
        self.reason = ""  # why it failed: connect, status_5xx, status_429, ttft_deadline
        self.fatal: GatewayError | None = None  # no capacity, broken bytes: not retried

    @property
    def ok(self) -> bool:
        """Answered: a first token, a 200, or a status that retrying would not change."""
        return self.error is None and self.fatal is None and not self.reason

    @property
    def streaming(self) -> bool:
        """Answered with a stream to read on (a 200 after its first token)."""
        return self.ok and self.resp is not None and self.resp.status == 200

    def discard(self, status: int | None) -> None:
        """This attempt will not be used: close its response and release its permit."""
        if self.resp is not None:
            self.resp.close()
            self.resp = None
        self.span.end(self.reason or "discarded")
        self.ticket.failed(status)

    def failure(self) -> GatewayError:
        """What the client is told when this failed attempt was the last."""
        if self.fatal is not None:
            return self.fatal
        if self.error is not None:
            return self.error
        status = self.resp.status if self.resp is not None else 502
        return GatewayError(
            502 if status < 500 else status,
            f"Upstream '{self.upstream.name}' answered with status {status}.",
            code="upstream_error",
        )


def deadline_for(policy: Policy, req: Request, upstream: HttpUpstream) -> float | None:
    """An attempt's own bound: a stream's TTFT deadline (it covers the headers too: some
    upstreams send them with the first token) under the upstream's fixed read timeout; none
    for a non-streamed answer (its latency is the whole generation). The request's scope caps
    it in `send`."""
    if not req.stream:
        return None
    ttft = policy.ttft_deadline(upstream.name, req.model, req.cls)
    cap = upstream.settings.read_timeout_seconds
    return cap if ttft is None or ttft > cap else ttft  # (min(): ~700 instructions)


async def send(
    policy: Policy,
    a: Attempt,
    req: Request,
    body: bytes,
    *,
    first_token: bool,
    deadline: float | None,
    front: bool = False,
) -> Attempt:
    """Waits for limiter capacity (`front`: at the head of the queue), sends, and waits for
    the headers (`first_token`: and for the first token of a 200 stream), within `deadline`
    capped by the request's scope. Never raises except on cancellation (then the attempt
    closes what it opened)."""
    scope = req.scope
    name = a.upstream.name
    queued = req.trace.queue(name)
    try:
        await a.ticket.acquire(name, front)  # within the queue deadline and the scope
    except BaseException as e:
        queued.fail(e)
        if not isinstance(e, GatewayError):
            raise
        # Kept without its traceback, which holds this frame and so `a` (a cycle for the
        # garbage collector with the whole request); raised again, it gets a new one.
        a.fatal = e.with_traceback(None)  # no capacity in time
        return a
    u = a.upstream.settings
    a.span = req.trace.attempt(queued, a.role, name, u.api, u.url)
    a.sent_at = policy.clock.now()
    deadline = scope.cap(deadline)
    try:
        with Timeout(deadline):
            try:
                resp = await a.upstream.post(
                    req.dialect.path,
                    body,
                    req.request_id,
                    req.stream,
                    pace=req.pace,
                    trace=a.span.headers(),  # the upstream joins the trace
                )
            except GatewayError as e:
                a.error, a.reason = e.with_traceback(None), "connect"  # (as a.fatal above)
                a.span.end("connect")
                a.ticket.failed(e.status)
                policy.unhealthy(name)
                if e.code == PROTOCOL_ERROR:
                    a.fatal = e  # broken bytes: asking again gets the same (not retried)
                return a
            a.resp = resp
            a.span.status(resp.status)
            full = await a.ticket.arrived(resp.status, resp.headers, a.upstream.private)
            if resp.status == 429 or resp.status >= 500:
                a.reason = "status_429" if resp.status == 429 else "status_5xx"
                if full:
                    a.reason = "full"
                elif resp.status != 429:  # a 429, a full upstream: the limiter's business
                    policy.unhealthy(name)
                a.span.mark(a.reason)
                return a
            if resp.status == 200 and first_token:
                await _first_token(a, resp, req.dialect)
                a.span.event("first_token")
            a.first_at = policy.clock.now()
    except TimeoutError:
        if scope.passed():  # the whole-request deadline
            a.error, a.reason = scope.error(True), "deadline"
            if scope.client:  # the client's own bound: nothing learned about the upstream
                a.discard(None)
                return a
        else:
            within = f" within {deadline:.3g} s" if deadline is not None else " in time"
            what = "first token" if req.stream else "answer"
            a.error = GatewayError(
                504, f"Upstream '{name}' sent no {what}{within}.", code="upstream_timeout"
            )
            a.reason = "ttft_deadline"
        a.discard(504)
        policy.unhealthy(name)
        return a
    except (UpstreamError, sse.SSEProtocolError) as e:  # broke while reading the prefix
        a.error = GatewayError(
            502, "the upstream connection broke", code="upstream_stream_truncated"
        )
        a.reason = "connect"
        a.discard(502)
        policy.unhealthy(name)
        if isinstance(e, BROKEN_BYTES):
            a.fatal = GatewayError(502, str(e), code=PROTOCOL_ERROR)  # not retried
        return a
    except asyncio.CancelledError:
        a.span.mark("cancelled")  # (unless the race marked it lost already)
        a.discard(None)  # the client left (or a hedge lost): not the upstream's doing
        raise
    policy.healthy(name)
    return a


async def _first_token(a: Attempt, resp: UpstreamResponse, dialect: Dialect) -> None:
    """Reads until the first token, an error, a finish or the end; what was read is kept in
    `a.prefix` for the relay (at most PREFIX_LIMIT bytes plus one read)."""
    decoder = sse.SSEDecoder()
    size = 0
    async for chunk in resp.iter_any():
        a.prefix.append(chunk)
        size += len(chunk)
        for data, comment, event in decoder.feed(chunk):
            if comment:
                continue
            try:
                piece = dialect.read(data, event, None, False)
            except (sse.SSEProtocolError, *sse.SHAPE_ERRORS):
                return  # the relay's parser reports it
            if piece is not None and piece.first:
                return
        if size > PREFIX_LIMIT:
            return


def _failed_last(order: list[HttpUpstream], failed: list[str]) -> list[HttpUpstream]:
    """`order` with the upstreams that failed moved to the end, least recent failure first:
    every upstream is tried before one that failed is tried again."""
    if not failed:
        return order
    rank = {name: i for i, name in enumerate(failed)}
    fresh = [u for u in order if u.name not in rank]
    return fresh + sorted((u for u in order if u.name in rank), key=lambda u: rank[u.name])


class Tries:
    """The sends one retry loop may make: `used` of `limit`, counted under `label` in
    tokenpipe_retries_total (default: the reason of each retry)."""

    __slots__ = ("label", "limit", "used")

    def __init__(self, limit: int, used: int = 0, label: str | None = None) -> None:
        self.limit = limit
        self.used = used
        self.label = label


async def until_answered(
    policy: Policy,
    req: Request,
    tries: Tries,
    *,
    body: bytes,
    first_token: bool,
    ticket: Callable[[], Ticket],
    avoid: str | None = None,
    reason: str | None = None,
    eligible: Callable[[HttpUpstream], bool] | None = None,
) -> Attempt | None:
    """The one retry loop: sends (to the upstreams serving the model, in order, those that failed
    going last, the most recent failure last of all) until an attempt is answered, and
    returns it; or returns the last failed attempt (not yet discarded: the caller passes it
    on or discards it), or None when nothing could be sent. `reason`: why the first send of
    this loop is a retry already (the request's first send is not; its loop passes None).

    Each retry needs a send left (`tries`), time left in the request's scope and the retry
    budget. The loop stops at an answer, at a failure no retry would change (no limiter
    capacity, broken bytes, the scope passed) and when the model's only upstream answered 429
    asking for a longer pause than `retries.max_429_wait_seconds` (the client decides). A retry
    to the upstream that just failed waits a jittered backoff first (within the scope). A
    refusal from a full upstream is sent again without a try or the budget, at the head of
    the limiter's queue, up to MAX_REQUEUES times (the limiter, not a backoff, paces it).
    `avoid`: an upstream that failed before this loop (the stream's own, for a retry or a
    continuation)."""
    retries = policy.settings.retries
    last: Attempt | None = None
    order: list[HttpUpstream] = []
    failed: list[str] = [avoid] if avoid is not None else []  # least recent first
    requeues = 0
    try:
        while True:
            full = False
            if last is not None:
                if last.fatal is not None or last.reason == "deadline":
                    return last
                if (
                    last.reason == "status_429"
                    and len(order) == 1
                    and last.resp is not None
                    and retry_after(last.resp.headers) > retries.max_429_wait_seconds
                ):
                    return last  # the only upstream asks for a long pause: the client decides
                reason = last.reason or "connect"
                full = reason == "full" and requeues < MAX_REQUEUES
                name = last.upstream.name
                if name in failed:
                    failed.remove(name)
                failed.append(name)
            if full:  # waits for a slot again: not a try, not the budget's
                if req.scope.passed():
                    return last
                requeues += 1
                metrics.RETRIES.labels("full", "requeued").inc()
            elif reason is not None and (  # this send is a retry
                req.scope.passed()
                or not policy.may_retry(tries.used, tries.limit, reason, tries.label)
            ):
                return last
            if req.upstreams is not None:  # the request's first send
                order = policy.arrange(req.model, req.upstreams)
                req.upstreams = None
            else:
                order = await policy.order(req.model, req.dialect.api)
            if eligible is not None:
                order = [u for u in order if eligible(u)]
            target = policy.pick(_failed_last(order, failed))
            if target is None:
                return last
            if last is not None:
                last.discard(last.resp.status if last.resp is not None else 502)
                last = None
            if reason is not None and not full and failed and target.name == failed[-1]:
                # The upstream that just failed, again: back off first (within the scope).
                pause = backoff(
                    tries.used, retries.backoff_base_seconds, retries.backoff_cap_seconds
                )
                await asyncio.sleep(min(pause, req.scope.left()))
            if not full:
                tries.used += 1
            # The first send of the request, a retry, or a continuation (a loop of its own).
            role = "first" if reason is None else "retry"
            if tries.label == "midstream":
                role = "continuation"
            a = await send(
                policy,
                Attempt(target, ticket(), role=role),
                req,
                body,
                first_token=first_token,
                deadline=deadline_for(policy, req, target),
                front=full,
            )
            if a.ok:
                return a
            last = a
    except BaseException:
        # Cancelled (the client left) while backing off or choosing: a failed answer kept
        # for the caller must not stay open upstream.
        if last is not None:
            last.discard(None)
        raise
