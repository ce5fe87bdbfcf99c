"""The gate in front of one upstream: waits, fairly across API keys, for capacity.

Capacity is three things at once: the request bucket, the token bucket (both learned from
the upstream's headers, or configured, and kept in a `Store`), and an adaptive concurrency
limit (`AIMDLimit`, this process only). A request takes a `Permit` when all three allow it.

Fairness: waiters queue per API key (FIFO within a key) and the keys take turns, so a key
that sends a thousand requests delays another key's next request by at most one turn
(control/fairqueue.py).
One dispatcher task, owned by the limiter, serves the queue; it exists only while someone
waits. Bounds: at most `max_waiting` waiters (the next one gets 429 at once) and each waits
at most its deadline (then 429 with Retry-After and x-ratelimit-* headers).

A cold concurrency limit (`limits.initial_concurrency`) lets that many requests out before
anything is known of the upstream. Its first 200 opens it (`AIMDLimit.open`) when the
upstream needs no probing: it is on this machine or a private network, a self-hosted engine
(vLLM, llama.cpp, `tokenpipe local`) with no provider's quota, which when full queues or
refuses (503: `AIMDLimit.cap`); or its quotas are known (its headers, learned by then, or
the config), and the buckets pace the rest. A public upstream with no quota known may have
limits out of sight: slow start probes them, doubling the limit per round of answers, so a
hidden quota of 100 is met with ~130 requests in flight, not a whole burst. Not at the
warm-up's answer (pipeline.py): a private server may have a quota (a proxy, the sim's
--rpm) that only a request's answer shows. An opened burst is a flood of requests that
reach the upstream in any order, which learning from headers allows for (control/levels.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control import levels, ratelimit_headers
from tokenpipe.control.aimd import AIMDLimit
from tokenpipe.control.bounds import ClampLog
from tokenpipe.control.fairqueue import FairQueue, Waiter
from tokenpipe.control.ratelimit_headers import learned_spec, rate_headers
from tokenpipe.control.store import Decision, Limits, Store
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics

log = logging.getLogger("tokenpipe.limiter")
#: Out-of-range rate-limit headers: one line per (upstream, kind) per minute, all limiters.
_clamp_log = ClampLog(log)

#: Statuses that mean "send less": they shrink the concurrency limit (529: Anthropic's
#: overloaded_error, its 503).
DROP_STATUSES = frozenset({429, 503, 504, 529})
#: Refusals that, while the upstream holds accepted streams, mean "full" (AIMDLimit.cap).
FULL_STATUSES = frozenset({503, 529})
#: Pause after a 429 that named no retry time (seconds).
DEFAULT_RETRY = 1.0
#: Longest Retry-After we tell a client (seconds): an estimate beyond it is not worth more.
MAX_RETRY_AFTER = 600.0
#: Safety margins under learned levels: requests, and a share of the token bucket's depth.
REQUEST_MARGIN = 0.5
TOKEN_MARGIN = 0.002
#: Longest the dispatcher sleeps before looking again (seconds): news from headers or a
#: released permit wake it sooner.
MAX_NAP = 0.25

Sleep = Callable[[float], Awaitable[None]]


@dataclass(eq=False, slots=True)
class Permit:
    limiter: Limiter
    key: str
    tokens: float  # reserved
    decision: Decision
    inflight_at_start: int
    granted_at: float  # clock seconds
    released: bool = False
    #: The upstream's 200 already counted as a success for the concurrency limit.
    grew: bool = False
    #: Refused by a full upstream: the limit was cut to what it holds (`observe`), which is
    #: what it can take, so the release takes no multiplicative share off that as well.
    full: bool = False


class Limiter:
    def __init__(
        self,
        name: str,
        store: Store,
        *,
        configured: Limits | None = None,
        learn: bool = True,
        concurrency: AIMDLimit | None = None,
        clock: Clock = MONOTONIC,
        max_waiting: int = 10_000,
        sleep: Sleep | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self.scope = f"up:{name}"
        self.store = store
        self.limits = configured or Limits()
        self.learn_enabled = learn
        self.concurrency = concurrency
        self.clock = clock
        self.max_waiting = max_waiting
        self.wall = wall
        self.inflight = 0
        #: Permits the upstream answered 200 and that are not released yet (a subset of
        #: `inflight`, counted only with a concurrency limit): what it holds when it refuses.
        self.accepted = 0
        #: Seconds a permit is held, smoothed (EWMA, 0.2 per release): with the concurrency
        #: limit and the queue it gives the expected wait a 429 tells the client.
        self._held = 0.0
        self._sleep = sleep or self._nap
        self._wake = asyncio.Event()
        self._queue = FairQueue()  # bound: max_waiting
        self._task: asyncio.Task[None] | None = None
        self._last: Decision | None = None
        #: Permits the upstream has not answered yet, oldest first (with header learning
        #: only; a dict keeps the order: OrderedDict's pop costs ~3x as much). Bound: the
        #: permits in flight; each leaves at its answer or its release.
        self._unanswered: dict[Permit, None] = {}
        #: Until when a 200's headers are not read (levels.LEARN_EVERY_S; None: every answer's).
        self._learn_at: float | None = None
        self._m_wait = metrics.LIMITER_WAIT.labels(name)
        self._m_429 = metrics.UPSTREAM_429.labels(name)
        self._m_conc = metrics.CONCURRENCY_LIMIT.labels(name)
        self._m_remaining: dict[str, Any] = {}  # by kind (requests, tokens): two at most
        if concurrency is not None:
            self._m_conc.set(concurrency.limit)

    # -- acquiring -------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self._queue.waiting

    def _concurrency_ok(self) -> bool:
        return self.concurrency is None or self.concurrency.allows(self.inflight)

    def _grant(self, key: str, tokens: float, d: Decision) -> Permit:
        self.inflight += 1
        permit = Permit(self, key, tokens, d, self.inflight, self.clock.now())
        if self.learn_enabled:
            self._unanswered[permit] = None
        return permit

    async def acquire(
        self, key: str, tokens: float, deadline: float, front: bool = False
    ) -> Permit:
        """Waits up to `deadline` seconds for capacity; past it raises a 429 GatewayError.
        `front`: the request was refused as the upstream filled up (`observe`), and waits at
        the head of its key's queue, the place it had."""
        start = self.clock.now()
        if not self._queue.waiting and self._concurrency_ok():
            d = await self.store.reserve(self.scope, self.limits, tokens)
            self._last = d
            if d.wait == 0.0 and self._concurrency_ok():
                self._m_wait.observe(0.0)
                return self._grant(key, tokens, d)
            if d.wait == 0.0:  # lost the concurrency race while asking the store
                self.store.give(self.scope, self.limits, 1.0, tokens)
        if self._queue.waiting >= self.max_waiting:
            raise self._too_busy(f"{self._queue.waiting} requests are already waiting")
        waiter = Waiter(key, tokens, asyncio.get_running_loop().create_future())
        self._queue.push(waiter, front)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._dispatch())
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result when
            # the caller is cancelled in the step the permit is granted, and the caller's
            # cancellation (the client left) is lost. No shield either: a cancel that finds
            # the future pending cancels it (the dispatcher skips it), and one that comes
            # after the grant leaves the permit in it, which the handlers below keep or
            # release (a shield cost an outer future and two callbacks per waiter).
            async with asyncio.timeout(deadline):
                permit = await waiter.future
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                permit = waiter.future.result()  # granted as the deadline struck: keep it
            else:
                waiter.future.cancel()
                raise self._too_busy(
                    f"no capacity within the {deadline:.3g} s this request could wait",
                    waited=deadline,
                ) from None
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result(), status=None, sent=False)
            else:
                waiter.future.cancel()
            raise
        self._m_wait.observe(self.clock.now() - start)
        return permit

    async def _dispatch(self) -> None:
        while True:
            self._wake.clear()  # before looking, so news that comes while we nap wakes us
            w = self._queue.head()
            if w is None:
                return
            if not self._concurrency_ok():
                await self._sleep(MAX_NAP)
                continue
            d = await self.store.reserve(self.scope, self.limits, w.tokens)
            self._last = d
            if d.wait > 0.0:
                await self._sleep(min(d.wait, MAX_NAP))
                continue
            if w.future.done():  # gave up while the store answered: undo the reservation
                self.store.give(self.scope, self.limits, 1.0, w.tokens)
                continue
            self._queue.served()
            w.future.set_result(self._grant(w.key, w.tokens, d))

    async def _nap(self, seconds: float) -> None:
        # asyncio.timeout, not wait_for: on 3.11 wait_for wraps the wait in a task of its
        # own, one per nap, and a cold burst naps once per answer (~1,000 times).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    # -- learning and releasing ------------------------------------------------------------

    async def observe(
        self, permit: Permit, status: int, headers: Mapping[str, str], private: bool = False
    ) -> bool:
        """The upstream answered `permit`'s request: learn its limits and any pause. True:
        the answer is a refusal from an upstream that is full, not failing (a 503 or 529
        while it holds streams it accepted): the limit falls to what it holds, and the
        request may wait for a slot again (router/attempt.py). `private`: the answer came
        from this machine or a private network (the module doc: it opens a cold limit)."""
        self._unanswered.pop(permit, None)
        names = (
            ratelimit_headers.limit_names(headers)
            if status == 429
            or (
                self.learn_enabled
                and (self._learn_at is None or self.clock.now() >= self._learn_at)
            )
            else None
        )
        info = ratelimit_headers.parse(headers, self.wall(), names) if names is not None else None
        if info is not None and info.notes:
            _clamp_log.report(self.name, info.notes)
        if info is not None and info.readings and self.learn_enabled:  # (a pause alone: below)
            requests, tokens = info.requests, info.tokens
            old = self.limits
            learned_r = learned_spec(old.requests, requests)
            learned_t = learned_spec(old.tokens, tokens)
            # Kept as they were (as on most answers: learned_spec gives back the same Spec):
            # the store fits a scope's buckets once per Limits object, so a new equal one
            # would refit them on every answer.
            if learned_r is not old.requests or learned_t is not old.tokens:
                self.limits = Limits(learned_r, learned_t)
            rem_r = requests.remaining if requests is not None else None
            rem_t = tokens.remaining if tokens is not None else None
            if rem_r is not None:
                self._remaining("requests").set(rem_r)
            if rem_t is not None:
                self._remaining("tokens").set(rem_t)
            now = self.clock.now()
            self._learn_at = levels.next_reading(self.limits, rem_r, rem_t, now)
            if rem_r is not None or rem_t is not None:
                # Learned levels sit a little below what the upstream said: the clocks of
                # replicas, Redis and the upstream differ by milliseconds, and arriving a hair
                # early costs a 429. At saturation this shifts when the bucket is read, not how
                # much flows through it, so it costs no throughput.
                if rem_r is not None:
                    rem_r -= REQUEST_MARGIN
                if rem_t is not None and self.limits.tokens is not None:
                    rem_t -= TOKEN_MARGIN * self.limits.tokens.capacity
                since = levels.counted_from(self._unanswered, permit, now)
                await self.store.learn(self.scope, self.limits, rem_r, rem_t, since)
        if status == 200 and self.concurrency is not None and not permit.grew:
            # A success as soon as the upstream accepts (headers), not when the stream ends:
            # a burst above the limit then waits for the first answers, not for whole streams.
            permit.grew = True
            self.accepted += 1
            self.concurrency.sample(permit.inflight_at_start, False)
            if private or self.limits:  # no probing needed (the module doc)
                self.concurrency.open()
            self.concurrency.holds(self.accepted)
            self._m_conc.set(self.concurrency.limit)
        full = False
        if status in FULL_STATUSES and self.concurrency is not None and self.accepted > 0:
            full = permit.full = True
            self._m_conc.set(self.concurrency.cap(self.accepted))
        if status == 429:
            self._m_429.inc()
            retry = info.retry_after if info and info.retry_after is not None else DEFAULT_RETRY
            log.info("upstream %s answered 429: pausing it for %.3g s", self.name, retry)
            await self.store.pause(self.scope, retry)
        self._wake.set()
        return full

    def _remaining(self, kind: str) -> Any:
        """The gauge of what the upstream says is left of `kind`'s bucket (made at the first
        answer that says it, not before: a gauge shows 0 until it is set)."""
        gauge = self._m_remaining.get(kind)
        if gauge is None:
            gauge = self._m_remaining[kind] = metrics.RATELIMIT_REMAINING.labels(self.name, kind)
        return gauge

    def release(
        self,
        permit: Permit,
        status: int | None,
        sent: bool = True,
        charged_tokens: float | None = None,
    ) -> None:
        """The request ended. `sent=False`: it never reached the upstream (all is returned);
        `charged_tokens`: what the upstream counted, which corrects the reservation."""
        if permit.released:
            return
        permit.released = True
        self._unanswered.pop(permit, None)
        self.inflight -= 1  # first: the slot comes back whatever the bookkeeping below does
        if permit.grew:
            self.accepted -= 1
        held = self.clock.now() - permit.granted_at  # (max(): ~700 instructions)
        self._held = 0.8 * self._held + (0.2 * held if held > 0.0 else 0.0)
        try:
            if not sent:
                self.store.give(self.scope, self.limits, 1.0, permit.tokens)
            elif charged_tokens is not None and charged_tokens != permit.tokens:
                self.store.give(self.scope, self.limits, 0.0, permit.tokens - charged_tokens)
            if self.concurrency is not None and status is not None and not permit.full:
                dropped = status in DROP_STATUSES
                if dropped or not permit.grew:
                    self.concurrency.sample(permit.inflight_at_start, dropped)
                    self._m_conc.set(self.concurrency.limit)
        finally:
            self._wake.set()

    # -- the 429 we send when waiting would take too long ----------------------------------

    def _too_busy(self, why: str, waited: float = 0.0) -> GatewayError:
        headers = rate_headers(self.limits, self._last)
        retry = self.expected_wait(waited)
        return GatewayError(
            429,
            f"Upstream '{self.name}' is at capacity "
            f"({why}; {self._queue.waiting} requests waiting). "
            f"Please retry after {math.ceil(retry)} s.",
            code="rate_limit_exceeded",
            headers=headers,
            retry_after=retry,
        )

    def expected_wait(self, waited: float = 0.0) -> float:
        """Seconds until a request joining the queue now would likely be served: the longest
        of what the rate limit, the concurrency limit (permits held `_held` s on average, or
        at least `waited`: no permit came back while a request waited that long) and the
        store's last answer say; at least DEFAULT_RETRY, at most MAX_RETRY_AFTER."""
        ahead = self._queue.waiting + 1
        retry = DEFAULT_RETRY
        if self.limits.requests is not None and self.limits.requests.rate > 0:
            retry = max(retry, ahead / self.limits.requests.rate)
        if self.concurrency is not None and self.inflight >= int(self.concurrency.limit):
            held = max(self._held, waited)
            retry = max(retry, ahead * held / max(1, int(self.concurrency.limit)))
        if self._last is not None:
            retry = max(retry, self._last.wait)
        return min(MAX_RETRY_AFTER, retry)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._queue.cancel_all()
        self._unanswered.clear()
