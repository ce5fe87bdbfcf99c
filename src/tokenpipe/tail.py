"""Tail-latency control around the upstream call: adaptive deadlines, retries within a budget,
hedged first tokens, ordered fallbacks, circuit breaking and mid-stream recovery.

Two places in the request path:

- `TailControl.open` (from `Gateway.open`) sends the request: the upstreams serving the model
  in `tail.fallbacks` order (else config order), an upstream whose circuit is open passed
  over; connect errors, 5xx and 429 are retried with jittered backoff on the next upstream,
  within `max_attempts` and the retry budget. It returns at the response headers, so the
  client's stream (and its role chunk) starts at once.
- `StreamGuard` (in the relay's reader, `relay.read_upstream`) handles the stream: until the
  first content token it races: after the hedge delay (p95 of TTFT) a second request goes
  out, within the hedge budget and only if the limiter has room at once; the first stream
  with content wins and the other is closed at once; past the TTFT deadline (clamp(k x p99,
  floor, ceiling) for this upstream, model and prompt size) the attempt is retried. After
  it: the stall deadline on each gap between reads, and `resume`, which continues a text
  completion cut after content on a healthy upstream (prompt + text so far), feeding the
  same accumulator.

Non-streamed requests keep the simple path: retries, fallbacks and the breaker apply to the
response status, but there is no first token to race for, so no TTFT deadline and no hedge
(a non-streamed answer arrives whole; its latency is the whole generation). Streaming it
upstream and assembling would make both possible; not done: it changes what the upstream
is asked for and what its usage and errors look like, for little gain over a client that
streams.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import orjson

from tokenpipe import sse
from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control.breaker import CircuitBreaker, State
from tokenpipe.control.budget import RatioBudget, backoff
from tokenpipe.control.deadline import DEADLINE_HEADER, AdaptiveDeadline, End
from tokenpipe.control.quantiles import RollingQuantiles
from tokenpipe.control.traffic import Ticket
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics
from tokenpipe.relay import Accumulator, EventParser, Piece, chunk_has_content, push_taker
from tokenpipe.router import Router
from tokenpipe.settings import DeadlineSettings, TailSettings
from tokenpipe.upstream.errors import UpstreamError
from tokenpipe.upstream.h1 import UpstreamProtocolError, UpstreamResponse
from tokenpipe.upstream.http import PROTOCOL_ERROR, HttpUpstream

log = logging.getLogger("tokenpipe.tail")

#: Bytes an attempt may read before its first content token (role chunks, comments); past
#: it the attempt counts as answered and the relay takes over (bounds the prefix buffer).
PREFIX_LIMIT = 64 * 1024
__all__ = ["DEADLINE_HEADER", "StreamGuard", "TailControl"]
#: Estimators kept; the least recently created is dropped past this (bounds memory when
#: clients send many model names).
MAX_ESTIMATORS = 4096
#: The upstream's bytes are broken (SSE/JSON, HTTP/1.1 framing): reported, never retried.
_BROKEN_BYTES = (sse.SSEProtocolError, UpstreamProtocolError)


def _rule(d: DeadlineSettings, min_samples: int) -> AdaptiveDeadline:
    return AdaptiveDeadline(
        k=d.k,
        quantile=d.quantile,
        floor=d.floor_seconds,
        ceiling=d.ceiling_seconds,
        initial=d.initial_seconds,
        min_samples=min_samples,
    )


def prompt_class(tokens: int) -> int:
    """Prompt size class for TTFT estimates: prefill time grows with the prompt, so a 30k-token
    prompt is not judged by what 100-token prompts do. Classes: <1k, <4k, <16k, more."""
    if tokens < 1024:
        return 0
    return min(3, 1 + int(math.log(tokens / 1024, 4)))


class Attempt:
    """One send to one upstream, up to its first content token (streams) or its headers."""

    __slots__ = (
        "error",
        "fatal",
        "first_at",
        "hedge",
        "prefix",
        "reason",
        "resp",
        "sent_at",
        "ticket",
        "upstream",
    )

    def __init__(self, upstream: HttpUpstream, ticket: Ticket, hedge: bool = False) -> None:
        self.upstream = upstream
        self.ticket = ticket
        self.hedge = hedge
        self.resp: UpstreamResponse | None = None
        self.prefix: list[bytes] = []  # bytes read while waiting for the first token
        self.sent_at: float | None = None
        self.first_at: float | None = None
        self.error: GatewayError | None = None
        self.reason = ""  # why it failed: connect, status_5xx, status_429, ttft_deadline
        self.fatal: GatewayError | None = None  # no limiter capacity: not retried

    @property
    def ok(self) -> bool:
        """Answered: a first token, a 200, or a status that retrying would not change."""
        return self.error is None and self.fatal is None and not self.reason

    def discard(self, status: int | None) -> None:
        """This attempt will not be used: close its response and release its permit."""
        if self.resp is not None:
            self.resp.close()
            self.resp = None
        self.ticket.failed(status)


class TailControl:
    def __init__(self, settings: TailSettings, router: Router, clock: Clock = MONOTONIC) -> None:
        self.settings = settings
        self.router = router
        self.clock = clock
        self.ttft_rule = _rule(settings.ttft, settings.min_samples)
        self.stall_rule = _rule(settings.stall, settings.min_samples)
        r, h = settings.retries, settings.hedging
        self.retry_budget = RatioBudget(r.budget_ratio, r.budget_reserve, clock=clock)
        self.hedge_budget = RatioBudget(h.budget_ratio, h.budget_reserve, clock=clock)
        b = settings.breaker
        self.breakers = {
            u.name: CircuitBreaker(b.failures, b.cooldown_seconds, clock) for u in router.upstreams
        }
        # The circuit state gauge, set when it changes (it is looked at on every request).
        self._shown = dict.fromkeys(self.breakers, State.CLOSED)
        for name in self.breakers:
            metrics.UPSTREAM_STATE.labels(name).set(int(State.CLOSED))
        #: Some upstream continues a trailing assistant message (chat recovery is possible).
        self.continues_chat = any(u.settings.continue_final_message for u in router.upstreams)
        # (upstream, model, prompt class) -> TTFT; (upstream, model) -> gaps between reads.
        self._ttft: dict[tuple[str, str, int], RollingQuantiles] = {}
        self._gap: dict[tuple[str, str], RollingQuantiles] = {}
        # (upstream, model, prompt class) -> first tokens that never came (only counted).
        self._censored: dict[tuple[str, str, int], RollingQuantiles] = {}

    # -- estimates and deadlines ------------------------------------------------------------

    def _est(self, table: dict[Any, RollingQuantiles], key: Any) -> RollingQuantiles:
        est = table.get(key)
        if est is None:
            if len(table) >= MAX_ESTIMATORS:
                del table[next(iter(table))]
            est = table[key] = RollingQuantiles(self.settings.window_seconds, clock=self.clock)
        return est

    def ttft_estimate(self, upstream: str, model: str, cls: int) -> RollingQuantiles:
        return self._est(self._ttft, (upstream, model, cls))

    def gap_estimate(self, upstream: str, model: str) -> RollingQuantiles:
        return self._est(self._gap, (upstream, model))

    def ttft_deadline(self, upstream: str, model: str, cls: int) -> float | None:
        if not self.settings.deadlines:
            return None
        value = self.ttft_rule.value(self.ttft_estimate(upstream, model, cls))
        metrics.child(metrics.DEADLINE, "ttft", upstream, model).set(value)
        return value

    def stall_deadline(self, upstream: str, model: str) -> float | None:
        if not self.settings.deadlines:
            return None
        value = self.stall_rule.value(self.gap_estimate(upstream, model))
        metrics.child(metrics.DEADLINE, "stall", upstream, model).set(value)
        return value

    def censored(self, upstream: str, model: str, cls: int) -> None:
        """A first token that never came (the attempt lost to a hedge or hit the deadline):
        its TTFT is only known to be longer than everything seen."""
        self._est(self._censored, (upstream, model, cls)).add(1.0)

    def hedge_delay(self, upstream: str, model: str, cls: int) -> float:
        """The hedging quantile of TTFT, stalls included (Dean and Barroso: hedge after the
        95th percentile of expected latency). Stalls cut short have no TTFT, only a lower
        bound, so they count as above every TTFT seen: with c censored among n requests the
        q-quantile of all is the q x n / (n - c) quantile of the completed ones. Leaving them
        out would put the delay inside ordinary latency and hedge ~5% of ordinary requests;
        recording their wait as a TTFT would drag the delay up to the stalls themselves."""
        h = self.settings.hedging
        est = self.ttft_estimate(upstream, model, cls)
        q = None
        n = est.count
        if n >= self.settings.min_samples:
            cut = self._est(self._censored, (upstream, model, cls)).count
            q = est.quantile(min(1.0, h.quantile * (n + cut) / n))
        value = h.initial_delay_seconds if q is None else max(h.min_delay_seconds, q)
        metrics.child(metrics.DEADLINE, "hedge_delay", upstream, model).set(value)
        return value

    # -- upstream choice and health ----------------------------------------------------------

    def _ordered(self, candidates: list[HttpUpstream], model: str) -> list[HttpUpstream]:
        names = self.settings.fallbacks.get(model)
        if not names:
            return candidates
        by_name = {u.name: u for u in candidates}
        return [by_name[n] for n in names if n in by_name] or candidates

    def _pick(self, order: list[HttpUpstream], avoid: str | None = None) -> HttpUpstream | None:
        """The first upstream in order whose circuit lets a request through; `avoid` (the one
        that just failed) goes last. When every circuit is open the first is used anyway: the
        breaker reroutes, it never turns away a request no other upstream could serve (one
        client's failing requests must not take a single-upstream gateway down; the retry
        budget keeps the load on a failing upstream bounded)."""
        if avoid is not None:
            order = [u for u in order if u.name != avoid] + [u for u in order if u.name == avoid]
        for u in order:
            if not self.settings.breaker.enabled or self.breakers[u.name].allow():
                self._state(u.name)
                return u
        return order[0] if order else None

    def _state(self, name: str) -> None:
        state = self.breakers[name].state
        if self._shown[name] is not state:
            self._shown[name] = state
            metrics.UPSTREAM_STATE.labels(name).set(int(state))

    def _healthy(self, name: str) -> None:
        self.breakers[name].success()
        self._state(name)

    def _unhealthy(self, name: str) -> None:
        b = self.breakers[name]
        was = b.state
        b.failure()
        self._state(name)
        if b.state is State.OPEN and was is not State.OPEN:
            log.warning("upstream %s taken out for %.1f s (circuit open)", name, b.cooldown)

    def upstream_state(self, name: str) -> State:
        return self.breakers[name].state

    # -- one attempt -------------------------------------------------------------------------

    async def _attempt(
        self,
        a: Attempt,
        path: str,
        body: bytes,
        request_id: str,
        stream: bool,
        deadline: float | None,
        streamed: bool = False,
        end: End | None = None,
        pace: float | None = None,
    ) -> Attempt:
        """Sends and waits for the first token (`stream`) or the headers. `streamed`: the
        response is a stream even if its first token is not awaited here. Never raises except on
        cancellation (then the attempt closes what it opened)."""
        streamed = streamed or stream
        try:
            await a.ticket.acquire(a.upstream.name)
        except GatewayError as e:  # no capacity within the queue deadline
            a.fatal = e
            return a
        a.sent_at = self.clock.now()
        if streamed:  # the upstream's fixed read timeout bounds the wait for the first token
            cap = a.upstream.settings.read_timeout_seconds
            deadline = cap if deadline is None else min(deadline, cap)
        try:
            async with asyncio.timeout(deadline):
                try:
                    resp = await a.upstream.post(path, body, request_id, streamed, pace=pace)
                except GatewayError as e:
                    a.error, a.reason = e, "connect"
                    a.ticket.failed(e.status)
                    self._unhealthy(a.upstream.name)
                    if e.code == PROTOCOL_ERROR:
                        a.fatal = e  # broken bytes: asking again gets the same (not retried)
                    return a
                a.resp = resp
                await a.ticket.arrived(resp.status, resp.headers)
                if resp.status == 429 or resp.status >= 500:
                    a.reason = "status_429" if resp.status == 429 else "status_5xx"
                    if resp.status != 429:  # a 429 is the limiter's business, not health
                        self._unhealthy(a.upstream.name)
                    return a
                if resp.status == 200 and stream:
                    await self._first_token(a, resp)
                a.first_at = self.clock.now()
        except TimeoutError:
            if end is not None and end.passed(self.clock.now()):  # the whole-request deadline
                a.error, a.reason = end.error(True), "deadline"
                if end.client:  # the client's own bound: nothing learned about the upstream
                    a.discard(None)
                    return a
            else:
                within = f" within {deadline:.3g} s" if deadline is not None else " in time"
                what = "first token" if streamed else "answer"
                a.error = GatewayError(
                    504,
                    f"Upstream '{a.upstream.name}' sent no {what}{within}.",
                    code="upstream_timeout",
                )
                a.reason = "ttft_deadline"
            a.discard(504)
            self._unhealthy(a.upstream.name)
            return a
        except (UpstreamError, sse.SSEProtocolError) as e:
            a.error = GatewayError(
                502, "the upstream connection broke", code="upstream_stream_truncated"
            )
            a.reason = "connect"
            a.discard(502)
            self._unhealthy(a.upstream.name)
            if isinstance(e, (UpstreamProtocolError, sse.SSEProtocolError)):
                a.fatal = GatewayError(502, str(e), code=PROTOCOL_ERROR)  # not retried
            return a
        except asyncio.CancelledError:
            a.discard(None)  # the client left (or a hedge lost): not the upstream's doing
            raise
        self._healthy(a.upstream.name)
        return a

    async def _first_token(self, a: Attempt, resp: UpstreamResponse) -> None:
        """Reads until a content token, an error, a finish or [DONE]; what was read is kept in
        `a.prefix` for the relay (at most PREFIX_LIMIT bytes plus one read)."""
        decoder = sse.SSEDecoder()
        size = 0
        async for chunk in resp.iter_any():
            a.prefix.append(chunk)
            size += len(chunk)
            for data, comment, _ in decoder.feed(chunk):
                if comment:
                    continue
                if data == sse.DONE:
                    return
                try:
                    obj = orjson.loads(data)
                    if not isinstance(obj, dict) or obj.get("error") or chunk_has_content(obj):
                        return
                    for choice in obj.get("choices") or ():
                        if choice.get("finish_reason"):
                            return
                except (orjson.JSONDecodeError, RecursionError, AttributeError, TypeError):
                    return  # not JSON, or not a chunk's shape: the relay's parser reports it
            if size > PREFIX_LIMIT:
                return

    # -- the request -------------------------------------------------------------------------

    async def open(
        self,
        model: str,
        path: str,
        body: bytes,
        request_id: str,
        ticket: Ticket,
        *,
        stream: bool,
        headers: Mapping[str, str] | None = None,
        pace: float | None = None,
    ) -> tuple[HttpUpstream, UpstreamResponse, float, End | None]:
        """Sends the request, retrying and falling back on connect errors, 5xx and 429; returns
        (upstream, response with its headers, when it was sent, end of the whole-request
        deadline or None; both on this clock). The response is any status a retry would not
        change, or the last failure when no retry is left. A stream's first token is raced
        for later, by the relay's reader (StreamGuard.first_content)."""
        order = self._ordered(await self.router.candidates(model), model)
        self.retry_budget.request()
        self.hedge_budget.request()
        end = self._end(headers)
        end_at = None if end is None else end.at
        cls = prompt_class(ticket.cost.prompt)
        retries = self.settings.retries
        attempt_no = 0
        avoid: str | None = None
        last: Attempt | None = None
        try:
            while True:
                upstream = self._pick(order, avoid)
                if upstream is None:  # no candidates (router.candidates raises 404 first)
                    break
                if last is not None:
                    old: Attempt = last
                    last = None
                    old.discard(old.resp.status if old.resp is not None else 502)
                attempt_no += 1
                # The TTFT deadline covers the headers too (some upstreams send them with
                # the first token); the relay's reader enforces the rest (StreamGuard).
                deadline = self.ttft_deadline(upstream.name, model, cls) if stream else None
                if end_at is not None:
                    left = max(0.0, end_at - self.clock.now())
                    deadline = left if deadline is None else min(deadline, left)
                a = await self._attempt(
                    Attempt(upstream, ticket),
                    path,
                    body,
                    request_id,
                    False,
                    deadline,
                    streamed=stream,
                    end=end,
                    pace=pace,
                )
                if a.fatal is not None:
                    raise a.fatal
                if a.ok:
                    assert a.resp is not None
                    return a.upstream, a.resp, a.sent_at or self.clock.now(), end
                last = a
                if a.reason == "deadline":
                    break  # the whole-request deadline passed: no time for another
                if (
                    a.reason == "status_429"
                    and len(order) == 1
                    and a.resp is not None
                    and _retry_after(a.resp.headers) > retries.max_429_wait_seconds
                ):
                    break  # the only upstream asks for a long pause: the client decides
                if not self._may_retry(attempt_no, end_at, last.reason):
                    break
                avoid = last.upstream.name
                if len(order) == 1:  # the same upstream again: back off first
                    await asyncio.sleep(
                        backoff(
                            attempt_no, retries.backoff_base_seconds, retries.backoff_cap_seconds
                        )
                    )
        except BaseException:
            # Cancelled (the client left) while backing off or in the next attempt: the
            # failed answer kept for the client must not stay open upstream.
            if last is not None:
                last.discard(None)
            raise
        # Out of attempts: the client gets the last failure as it was.
        assert last is not None
        if last.resp is not None:
            return last.upstream, last.resp, last.sent_at or self.clock.now(), end
        assert last.error is not None
        raise last.error

    def _may_retry(self, attempt_no: int, end_at: float | None, reason: str) -> bool:
        """Another attempt is allowed: attempts left, time left, and the retry budget."""
        retries = self.settings.retries
        if not retries.enabled or attempt_no >= retries.max_attempts:
            return False
        if end_at is not None and self.clock.now() >= end_at:
            return False
        if not self.retry_budget.try_spend():
            metrics.RETRIES.labels(reason, "no_budget").inc()
            return False
        metrics.RETRIES.labels(reason, "retried").inc()
        return True

    def _end(self, headers: Mapping[str, str] | None) -> End | None:
        """The whole-request deadline: the gateway's `total_seconds` or the client's
        header, whichever is shorter (a header value <= 0 or non-finite is ignored)."""
        total = self.settings.total_seconds
        client = False
        if headers is not None:
            raw = headers.get(DEADLINE_HEADER)
            if raw is not None:
                try:
                    asked = float(raw)
                except ValueError:
                    raise GatewayError(
                        400,
                        f"{DEADLINE_HEADER} must be a number of seconds.",
                        param=DEADLINE_HEADER,
                        code="invalid_request",
                    ) from None
                if asked > 0 and math.isfinite(asked) and (total is None or asked < total):
                    total, client = asked, True
        if total is None:
            return None
        return End(self.clock.now() + total, total, client)


def continuable(path: str, obj: dict[str, Any]) -> bool:
    """Can a cut stream continue elsewhere? Text completions with one string prompt and one
    choice: the continuation is the prompt + the text so far. Chat with one choice and no
    tools: the messages + an assistant message holding the text so far, sent only to an
    upstream that continues a final assistant message (`upstreams[].continue_final_message`,
    vLLM's parameter of that name; an OpenAI-compatible upstream in general would answer it
    as a new turn)."""
    if obj.get("n") not in (None, 1) or obj.get("logprobs"):
        return False
    if path == "/chat/completions":
        return (
            isinstance(obj.get("messages"), list)
            and not obj.get("tools")
            and not obj.get("functions")
        )
    return (
        path == "/completions"
        and isinstance(obj.get("prompt"), str)
        and not obj.get("echo")
        and obj.get("best_of") in (None, 1)
        and obj.get("suffix") is None
    )


def _adopt(ticket: Ticket, side: Ticket) -> None:
    """The client's answer now comes from `side`'s send (a hedge or a retry): the request's
    own ticket takes over that permit, released when the request ends; `side` takes the
    request's old one (released already, when its attempt was closed)."""
    ticket.permit, side.permit = side.permit, ticket.permit
    ticket.status = side.status


class StreamGuard:
    """Tail control inside the relay's reader for one stream.

    Before the first content token (`first_content`): the first response is read straight
    into the accumulator (so a role chunk reaches the client at once) while a hedge goes out
    after the hedge delay and a retry after the TTFT deadline; whichever stream produces
    content first is read on, the others are closed at once, and the winner's events before
    its content (a second role chunk) are dropped. After it: the stall deadline on each read,
    gap samples, and `resume` after a cut.
    """

    __slots__ = (
        "_side",
        "_tail",
        "body",
        "cls",
        "continuations",
        "end",
        "end_at",
        "model",
        "now",
        "obj",
        "pace",
        "path",
        "raced",
        "recorded",
        "request_id",
        "responses",
        "sent_at",
        "stall",
        "ticket",
        "upstream",
    )

    def __init__(
        self,
        tail: TailControl,
        upstream: HttpUpstream,
        model: str,
        path: str,
        body: bytes,
        obj: dict[str, Any],
        request_id: str,
        ticket: Ticket,
        sent_at: float,
        end: End | None,
        pace: float | None = None,
    ) -> None:
        self._tail = tail
        self.upstream = upstream
        self.model = model
        self.path = path
        self.body = body
        self.obj = obj
        self.request_id = request_id
        self.ticket = ticket
        self.sent_at = sent_at
        self.end = end  # the whole-request deadline, None: none
        self.end_at = None if end is None else end.at
        self.pace = pace  # tokens/s sent upstream with each attempt (post's `pace`)
        self.cls = prompt_class(ticket.cost.prompt)
        self.stall = tail.stall_deadline(upstream.name, model)  # seconds, None: off
        self.continuations = 0
        #: The time of deadlines and gaps (the tail clock, seconds).
        self.now = tail.clock.now
        self.raced = False  # first_content ran (the relay's reader sets it)
        # Hedge, retry and continuation responses and their tickets, closed with the request
        # (bounded: one hedge, retries.max_attempts, recovery.max_continuations).
        self.responses: list[UpstreamResponse] = []
        self._side: list[Ticket] = []
        # Content deltas are recorded only when a cut stream could continue somewhere.
        self.recorded = (
            tail.settings.recovery.enabled
            and continuable(path, obj)
            and (path != "/chat/completions" or tail.continues_chat)
        )

    # -- before the first token --------------------------------------------------------------

    async def first_content(
        self, uresp: UpstreamResponse, parser: EventParser, acc: Accumulator
    ) -> UpstreamResponse:
        """Returns the response to read on, whose events up to its first content are in the
        accumulator already. Raises GatewayError when no stream produced content in time and
        no retry is left."""
        tail = self._tail
        hedging = tail.settings.hedging
        now = tail.clock.now()
        ttft = tail.ttft_deadline(self.upstream.name, self.model, self.cls)
        # The upstream's fixed read timeout bounds the wait whatever the adaptive deadline;
        # the error names the bound that is hit first.
        read_cap = self.upstream.settings.read_timeout_seconds
        ttft_end = self.sent_at + read_cap
        # The error is built only when it is raised (a GatewayError and its text per request
        # cost ~2% of the request path's CPU when built eagerly: py-spy, 1-token requests).
        late: Callable[[], GatewayError] = partial(_late, read_cap, "the upstream's read timeout")
        if ttft is not None and self.sent_at + ttft < ttft_end:
            ttft_end, late = self.sent_at + ttft, partial(_late, ttft, "the TTFT deadline")
        end = self.end
        if end is not None and end.at <= ttft_end:
            ttft_end, late = end.at, partial(end.error, True)
        client_bound = end is not None and end.client and ttft_end == end.at
        hedge_at = None
        if hedging.enabled:
            hedge_at = self.sent_at + tail.hedge_delay(self.upstream.name, self.model, self.cls)
        # Most first responses bring content before the hedge delay: read inline (no task, no
        # wait set) until the earlier of hedge time and TTFT deadline; the race below starts
        # only when that passes.
        due = ttft_end if hedge_at is None else min(hedge_at, ttft_end)
        scope = asyncio.timeout(max(0.0, due - now))
        try:
            async with scope:
                await _until_content(uresp, parser, acc)
        except TimeoutError:
            if not scope.expired():
                raise  # not ours: a read timeout below (a TimeoutError too)
        except Exception as e:
            if acc.write_error is not None or isinstance(e, _BROKEN_BYTES):
                raise
            return await self._primary_broke(uresp, parser, acc)
        else:
            return self._primary_won(uresp, None)
        primary: asyncio.Task[None] | None = asyncio.create_task(_until_content(uresp, parser, acc))
        hedge: asyncio.Task[Attempt] | None = None
        try:
            while True:
                waiting: set[asyncio.Task[Any]] = {t for t in (primary, hedge) if t is not None}
                if not waiting:
                    return await self._retry(uresp, parser, acc, "ttft_deadline", late())
                now = tail.clock.now()
                due = ttft_end if hedge_at is None else min(hedge_at, ttft_end)
                done, _ = await asyncio.wait(
                    waiting, timeout=max(0.0, due - now), return_when=asyncio.FIRST_COMPLETED
                )
                now = tail.clock.now()
                if primary in done:
                    primary_task, primary = primary, None
                    exc = primary_task.exception()
                    if exc is None:
                        return self._primary_won(uresp, hedge)
                    if acc.write_error is not None or isinstance(exc, _BROKEN_BYTES):
                        raise exc  # the client went away, or the upstream's bytes are broken
                    if hedge is None:
                        return await self._primary_broke(uresp, parser, acc)
                    tail._unhealthy(self.upstream.name)  # broke before any content
                    self.ticket.failed(502)
                if hedge is not None and hedge in done:
                    a = hedge.result()
                    hedge = None
                    if a.ok and a.resp is not None and a.resp.status == 200:
                        metrics.child(metrics.HEDGES, "won").inc()
                        if primary is not None:
                            try:
                                await _cancel(primary)
                            except BaseException:  # the client left meanwhile
                                a.discard(None)
                                raise
                            primary = None
                            # Censored: its TTFT is longer than we saw (see hedge_delay).
                            tail.censored(self.upstream.name, self.model, self.cls)
                            self.ticket.failed(499)
                        return self._switch(a, uresp, parser, acc)
                    metrics.child(metrics.HEDGES, "no_budget" if a.fatal else "failed").inc()
                    if a.resp is not None or a.fatal is None:
                        a.discard(a.resp.status if a.resp is not None else 502)
                    if primary is None:
                        return await self._retry(
                            uresp, parser, acc, a.reason or "connect", a.error or _broke()
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
                    self.ticket.failed(None)
                    raise late()
                if now >= ttft_end:
                    # No content from anyone in time: close all, then retry.
                    if primary is not None:
                        await _cancel(primary)
                        primary = None
                        self.ticket.failed(504)
                        tail.censored(self.upstream.name, self.model, self.cls)
                    if hedge is not None:
                        await _cancel(hedge)
                        hedge = None
                    tail._unhealthy(self.upstream.name)
                    return await self._retry(uresp, parser, acc, "ttft_deadline", late())
                if hedge_at is not None and now >= hedge_at:
                    hedge_at = None
                    attempt = await self._hedge()
                    if attempt is not None:
                        hedge = asyncio.create_task(
                            tail._attempt(
                                attempt,
                                self.path,
                                self.body,
                                self.request_id,
                                True,
                                max(0.001, ttft_end - now),
                                end=self.end,
                                pace=self.pace,
                            )
                        )
        finally:
            # Whatever happens (our own cancellation included), no attempt outlives this:
            # all are cancelled before any is awaited.
            left = [t for t in (primary, hedge) if t is not None]
            for t in left:
                t.cancel()
            try:
                for t in left:
                    await _cancel(t)
            finally:
                if hedge is not None:
                    _drop_unused(hedge, self.responses)

    def _primary_won(
        self, uresp: UpstreamResponse, hedge: asyncio.Task[Attempt] | None
    ) -> UpstreamResponse:
        """The first response produced content (or ended) first: it is read on."""
        tail = self._tail
        tail.ttft_estimate(self.upstream.name, self.model, self.cls).add(
            tail.clock.now() - self.sent_at
        )
        tail._healthy(self.upstream.name)
        if hedge is not None:
            metrics.child(metrics.HEDGES, "lost").inc()
        return uresp

    async def _primary_broke(
        self, uresp: UpstreamResponse, parser: EventParser, acc: Accumulator
    ) -> UpstreamResponse:
        """The first response broke before any content and no hedge is out: retry."""
        self._tail._unhealthy(self.upstream.name)
        self.ticket.failed(502)
        return await self._retry(uresp, parser, acc, "connect", _broke())

    async def _hedge(self) -> Attempt | None:
        """A second attempt for a request with no first token yet, if the budget allows."""
        tail = self._tail
        if not tail.hedge_budget.try_spend():
            metrics.child(metrics.HEDGES, "no_budget").inc()
            return None
        order = tail._ordered(await tail.router.candidates(self.model), self.model)
        target = tail._pick(order, avoid=self.upstream.name)
        if target is None:
            metrics.child(metrics.HEDGES, "no_budget").inc()
            return None
        side = self._side_ticket()
        side.deadline = tail.clock.now() + tail.settings.hedging.max_queue_seconds
        return Attempt(target, side, hedge=True)

    def _side_ticket(self) -> Ticket:
        """A ticket for an extra send: charged to the upstream's limiter (RPM/TPM), not again
        to the client's key quota."""
        t = self.ticket
        side = Ticket(t.traffic, t.key, t.cost, None)
        self._side.append(side)
        return side

    async def _retry(
        self,
        old: UpstreamResponse,
        parser: EventParser,
        acc: Accumulator,
        reason: str,
        error: GatewayError,
    ) -> UpstreamResponse:
        """Sends again (next upstream first) until a stream produces content, within the
        attempts and the retry budget; raises the last error when none is left."""
        tail = self._tail
        attempt_no = 1
        while tail._may_retry(attempt_no, self.end_at, reason):
            attempt_no += 1
            order = tail._ordered(await tail.router.candidates(self.model), self.model)
            target = tail._pick(order, avoid=self.upstream.name)
            if target is None:
                break
            if len(order) == 1:
                r = tail.settings.retries
                await asyncio.sleep(
                    backoff(attempt_no - 1, r.backoff_base_seconds, r.backoff_cap_seconds)
                )
            deadline = tail.ttft_deadline(target.name, self.model, self.cls)
            if self.end_at is not None:
                left = max(0.001, self.end_at - tail.clock.now())
                deadline = left if deadline is None else min(deadline, left)
            a = await tail._attempt(
                Attempt(target, self._side_ticket()),
                self.path,
                self.body,
                self.request_id,
                True,
                deadline,
                end=self.end,
                pace=self.pace,
            )
            if a.ok and a.resp is not None and a.resp.status == 200:
                return self._switch(a, old, parser, acc)
            if a.fatal is not None:
                raise a.fatal
            if a.reason == "deadline" and a.error is not None:
                raise a.error  # the whole-request deadline passed: no time for another
            if a.error is not None:
                error = a.error
            elif a.resp is not None:
                error = GatewayError(
                    502 if a.resp.status < 500 else a.resp.status,
                    f"Upstream '{target.name}' answered with status {a.resp.status}.",
                    code="upstream_error",
                )
            reason = a.reason or "connect"
            if a.resp is not None:
                a.discard(a.resp.status)
        raise error

    def _switch(
        self,
        a: Attempt,
        old: UpstreamResponse,
        parser: EventParser,
        acc: Accumulator,
    ) -> UpstreamResponse:
        """Reads on from attempt `a`: its events up to its first content were read into
        `a.prefix`; those before the content are dropped (the client has its role chunk)."""
        assert a.resp is not None
        old.close()
        _adopt(self.ticket, a.ticket)
        if a.sent_at is not None and a.first_at is not None:
            self._tail.ttft_estimate(a.upstream.name, self.model, self.cls).add(
                a.first_at - a.sent_at
            )
        self.upstream = a.upstream
        self.sent_at = a.sent_at or self.sent_at
        self.responses.append(a.resp)
        parser.decoder = sse.SSEDecoder()  # a partial event of the old stream is dropped
        content = False
        for chunk in a.prefix:
            if parser.at_end():  # raises a fault in what was read (the reader reports it)
                break
            for piece in parser.feed(chunk):
                if (
                    not content
                    and not piece.count
                    and piece.error is None
                    and piece.finish_reason is None
                    and piece.raw != sse.DONE_EVENT
                ):
                    continue
                content = True
                acc.put(piece)
        parser.at_end()
        return a.resp

    # -- after it ----------------------------------------------------------------------------

    def read_deadline(self, since: float) -> float:
        """When a read that started at `since` times out: the stall deadline after it, or
        the end of the whole-request deadline if sooner."""
        # The upstream's fixed read timeout bounds it whatever the adaptive deadline.
        cap = self.upstream.settings.read_timeout_seconds
        end = since + (cap if self.stall is None else min(self.stall, cap))
        if self.end_at is not None:
            end = min(end, self.end_at)
        return end

    def gap(self, seconds: float) -> None:
        self._tail.gap_estimate(self.upstream.name, self.model).add(seconds)

    def client_expired(self) -> bool:
        """The client's own deadline has passed (what ended the stream is not evidence
        against the upstream)."""
        end = self.end
        return end is not None and end.client and end.passed(self.now())

    def stall_error(self) -> GatewayError:
        """The error for a read that timed out: the bound that was hit (the relay's)."""
        end = self.end
        if end is not None and end.passed(self.now()):
            return end.error(False)
        cap = self.upstream.settings.read_timeout_seconds
        if self.stall is not None and self.stall < cap:
            bound = f"the stall deadline of {self.stall:.3g} s"
        else:
            bound = f"the upstream's read timeout of {cap:.3g} s"
        return GatewayError(
            504, f"the upstream stopped sending (no bytes within {bound})", code="upstream_timeout"
        )

    async def resume(
        self,
        error: GatewayError,
        parser: EventParser,
        acc: Accumulator,
        old: UpstreamResponse,
    ) -> UpstreamResponse | None:
        """Continues a cut text completion on a healthy upstream; None when it cannot (the
        relay then ends the stream with an error event that counts what was delivered)."""
        tail = self._tail
        if self.client_expired():
            return None  # the client's own deadline cut it: not the upstream's failure
        tail._unhealthy(self.upstream.name)
        texts = parser.texts()
        rec = tail.settings.recovery
        if not self.recorded or not texts:
            return None
        while self.continuations < rec.max_continuations:
            if self.end_at is not None and tail.clock.now() >= self.end_at:
                return None
            if not tail.retry_budget.try_spend():
                metrics.RETRIES.labels("midstream", "no_budget").inc()
                return None
            self.continuations += 1
            order = tail._ordered(await tail.router.candidates(self.model), self.model)
            if self.path == "/chat/completions":
                order = [u for u in order if u.settings.continue_final_message]
            target = tail._pick(order, avoid=self.upstream.name)
            if target is None:
                return None
            deadline = tail.ttft_deadline(target.name, self.model, self.cls)
            if self.end_at is not None:  # a continuation too ends with the request
                left = max(0.001, self.end_at - tail.clock.now())
                deadline = left if deadline is None else min(deadline, left)
            a = await tail._attempt(
                Attempt(target, self._side_ticket()),
                self.path,
                self._continuation(texts),
                self.request_id,
                True,
                deadline,
                end=self.end,
                pace=self.pace,
            )
            if a.ok and a.resp is not None and a.resp.status == 200:
                metrics.RETRIES.labels("midstream", "retried").inc()
                log.info(
                    "request %s: stream cut after %d deltas (%s), continued on %s",
                    self.request_id,
                    len(texts),
                    error.message,
                    target.name,
                )
                self.ticket.failed(error.status)
                return self._switch(a, old, parser, acc)
            if a.resp is not None:
                a.discard(a.resp.status)
        return None

    def _continuation(self, texts: list[str]) -> bytes:
        obj = dict(self.obj)
        so_far = "".join(texts)
        if self.path == "/chat/completions":
            obj["messages"] = [*self.obj["messages"], {"role": "assistant", "content": so_far}]
            obj["continue_final_message"] = True
            obj["add_generation_prompt"] = False
        else:
            obj["prompt"] = self.obj["prompt"] + so_far
        # One delta is one token for the servers we continue on (vLLM, llama.cpp, TGI and the
        # sim stream token by token); the remainder keeps the total length the client set.
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(obj.get(key), int):
                obj[key] = max(1, obj[key] - len(texts))
        return orjson.dumps(obj)

    def close(self) -> None:
        """Closes every extra response and finishes every side ticket, whatever one of them
        raises (the first error is raised at the end)."""
        first: BaseException | None = None
        for step in [r.close for r in self.responses] + [t.finish for t in self._side]:
            try:
                step()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first


async def _until_content(uresp: UpstreamResponse, parser: EventParser, acc: Accumulator) -> None:
    """Reads the first response into the accumulator until content, an error, a finish or
    the end (the relay's normal reading takes over from there).

    The first token goes by the push path (relay.push_taker): written in the loop step its
    bytes arrive. Read by this task instead, it waited for a wake-up behind the rest of that
    step's work, which the other streams' pushed tokens fill: +15 ms at p99 TTFT with 64
    paced streams (docs/performance.md). The taker nudges this task once content is out."""
    reached = False

    def check(pieces: list[Piece]) -> None:
        nonlocal reached
        if not reached and _has_first(parser, pieces):
            reached = True
            uresp.nudge()

    uresp.take(push_taker(uresp, parser, acc, check))
    try:
        while True:
            chunk = await uresp.readany()
            if not chunk:
                return  # nudged (content went out), or the end
            pieces = parser.feed(chunk)
            over = bool(pieces) and acc.deliver(pieces)
            # The end ([DONE], an error event) or a fault (raised) ends the race as well.
            if parser.at_end() or reached or _has_first(parser, pieces):
                return
            if over:
                await acc.wait_below_low()
    finally:
        uresp.take(None)


def _has_first(parser: EventParser, pieces: list[Piece]) -> bool:
    """These events end the wait for the first token: content, an error, a finish, [DONE]."""
    if parser.tally.done:
        return True
    for piece in pieces:
        if piece.count or piece.error is not None or piece.finish_reason is not None:
            return True
    return False


def _retry_after(headers: Mapping[str, str]) -> float:
    """Seconds a 429 asks us to wait (retry-after-ms or retry-after; 0 when absent)."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is not None:
            try:
                return float(raw) * scale
            except ValueError:
                return 0.0
    return 0.0


def _late(seconds: float, bound: str) -> GatewayError:
    return GatewayError(
        504,
        f"no first token from the upstream within {bound} of {seconds:.3g} s",
        code="upstream_timeout",
    )


def _broke() -> GatewayError:
    return GatewayError(
        502, "the upstream connection broke before the first token", code="upstream_unavailable"
    )


def _drop_unused(task: asyncio.Task[Attempt], used: list[UpstreamResponse]) -> None:
    """A hedge that finished in the same step as the primary won (or as we were cancelled)
    holds an open response nobody reads: closed here, else it streams on upstream."""
    if not task.done() or task.cancelled() or task.exception() is not None:
        return
    a = task.result()
    if a.resp is not None and a.resp not in used:
        a.discard(None)


async def _cancel(task: asyncio.Task[Any]) -> None:
    """Cancels `task` and waits for it. A cancellation of the caller itself (the client
    left while we waited) is not swallowed: it is raised once the task is done."""
    task.cancel()
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():  # the caller was cancelled, not the task: finish it, then go
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
            raise
    except Exception:
        pass  # its outcome no longer matters (it closed what it opened)
