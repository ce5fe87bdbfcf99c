"""Buckets shared by every gateway replica through Redis.

Each decision is one server-side Lua script (one round trip, atomic): refill from Redis'
own clock (`TIME`, so replicas need no synchronised clocks), check the pause and both
buckets, take the reservation. Learning from headers, pauses and corrections are scripts too
(`redis_scripts`). While a scope is far from its limits, the reservation also takes a lease
(`lease.py`): units from which the replica grants its next requests for up to 50 ms without
a round trip, given back when it ends.

If Redis cannot be reached within `timeout` seconds, the process falls back at once to a
local `MemoryStore` holding 1/N of every limit (N: the live replicas last counted through
Redis heartbeats), logs it and sets `tokenpipe_limits_redis_fallback` to 1. A background
task pings Redis every `RETRY` seconds; when it answers, decisions go back to Redis (resync:
the next upstream headers set the shared levels again; a Redis that lost its data starts
its buckets full, as a fresh gateway would).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections import deque
from collections.abc import Awaitable

from redis import asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control.bounds import MAX_PAUSE, finite
from tokenpipe.control.lease import LEASE_MAX_REQUESTS, LEASE_S, Lease, Leases
from tokenpipe.control.redis_scripts import GIVE, LEARN, PAUSE, RESERVE
from tokenpipe.control.store import Decision, Limits, MemoryStore
from tokenpipe.observe import metrics

log = logging.getLogger("tokenpipe.limits.redis")

#: Seconds between pings while Redis is down, and between heartbeats while it is up.
RETRY = 1.0
#: A replica that sent no heartbeat for this long no longer counts (seconds).
REPLICA_TTL = 5.0
#: Corrections and learned levels waiting to be sent; past this the oldest is dropped (the
#: next answer's headers correct levels anyway, so losing one costs a little accuracy,
#: never correctness).
MAX_PENDING = 10_000
#: Connections to Redis per process; a decision that finds none free within the timeout
#: falls back to the local share.
MAX_CONNECTIONS = 64


def _reraise_cancel() -> None:
    """Raises the CancelledError of a task that was cancelled inside a redis-py call which
    answered with a connection error instead (it catches the cancel to drop or release the
    connection). Taken for Redis failing, a client that left mid-decision put the replica on
    its local share, and a background task that went on made close() wait for it forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _spec_args(limits: Limits) -> list[float]:
    r, t = limits.requests, limits.tokens
    return [
        r.rate if r else 0.0,
        r.capacity if r else 0.0,
        t.rate if t else 0.0,
        t.capacity if t else 0.0,
    ]


def _num(s: bytes | str) -> float | None:
    text = s.decode() if isinstance(s, bytes) else s
    if not text:
        return None
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"non-finite value {text[:20]!r}")
    return x


def _lease_tokens(tokens: float) -> float:
    """The most tokens a lease taken by a request of `tokens` may hold."""
    return LEASE_MAX_REQUESTS * max(1.0, tokens)


def _decision(res: list[bytes], tokens: float) -> tuple[Decision, float, float]:
    """RESERVE's answer to a request of `tokens`, checked (a malformed one raises
    ValueError, never a NaN wait; a lease is bounded by the caps the script was given, as
    any peer's value): the decision, as if no lease had been taken, and the units leased
    (-1: no lease)."""
    wait, rs, ts, rl, tl, ep, lr, lt = res
    w = _num(wait) or 0.0
    if w < 0:
        raise ValueError("negative wait")
    lease_r, lease_t = _num(lr) or 0.0, _num(lt) or 0.0
    held_r = held_t = 0.0  # what the lease took, counted back into the request's figures
    if lease_r >= 0.0:
        held_r = lease_r = lease_r if lease_r < LEASE_MAX_REQUESTS else LEASE_MAX_REQUESTS
        cap = _lease_tokens(tokens)
        held_t = lease_t = lease_t if lease_t < cap else cap
    level_r, level_t = _num(rl), _num(tl)
    d = Decision(
        w,
        (_num(rs) or 0.0) - held_r,  # the request's own place in the count
        (_num(ts) or 0.0) - held_t,
        None if level_r is None else level_r + held_r,  # the levels with the lease in them
        None if level_t is None else level_t + held_t,
        int(ep),
    )
    return d, lease_r, lease_t


class RedisStore:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "tokenpipe",
        timeout: float = 0.25,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.timeout = timeout  # seconds for one decision before falling back
        self.replica_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.replicas = 1  # live replicas, from heartbeats
        self.fallback = MemoryStore(clock)
        self.healthy = True
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=timeout,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
        )
        self.redis = aioredis.Redis(connection_pool=pool)
        self._reserve = self.redis.register_script(RESERVE)
        self._learn = self.redis.register_script(LEARN)
        self._give = self.redis.register_script(GIVE)
        self._pause = self.redis.register_script(PAUSE)
        #: (script, scope, args): corrections and learned levels, in the order they came.
        self._pending: deque[tuple[AsyncScript, str, list[str | float]]] = deque(maxlen=MAX_PENDING)
        self._flush_now = asyncio.Event()
        self._closing = False  # close() asked the flush task to send what is queued and stop
        self._tasks: list[asyncio.Task[None]] = []
        self._leases = Leases(clock, self._lease_left)
        self.clock = clock

    def _key(self, scope: str) -> str:
        return f"{self.prefix}:{scope}"

    def _down(self, e: BaseException) -> None:
        if self.healthy:
            self.healthy = False
            self.fallback.share = 1.0 / max(1, self.replicas)
            metrics.LIMITS_FALLBACK.set(1)
            log.warning(
                "redis unreachable (%s): enforcing a local share (1/%d) of each limit",
                type(e).__name__,
                max(1, self.replicas),
            )

    async def reserve(self, scope: str, limits: Limits, tokens: float) -> Decision:
        leases = self._leases
        if (d := leases.take(scope, limits, tokens)) is not None:
            return d
        if (d := await leases.wait(scope, limits, tokens)) is not None:
            return d
        # A lease spent, old or for other limits: what it left goes back with this ask.
        back_r, back_t = leases.end(scope)
        if self.healthy:
            # A lease only for a started store (its flush task gives back what one leaves),
            # and one asked for at a time: the requests that come meanwhile wait for it (the
            # asker's call is bounded by Redis' timeouts, and so is their wait).
            share = 0.0
            if self._tasks and leases.ask(scope):
                share = 0.5 / max(1, self.replicas)
            try:
                call = self._reserve(
                    keys=[self._key(scope)],
                    args=[
                        *_spec_args(limits),
                        tokens,
                        back_r,
                        back_t,
                        share,
                        LEASE_MAX_REQUESTS,
                        _lease_tokens(tokens),
                    ],
                )
                res = await (self._shielded(call, scope, limits, tokens) if share else call)
                d, lease_r, lease_t = _decision(res, tokens)
                if lease_r >= 0.0:
                    until = self.clock.now() + LEASE_S
                    leases.hold(scope, Lease(limits, d, lease_r, lease_t, until))
                return d
            except (TimeoutError, RedisError, OSError) as e:
                _reraise_cancel()  # the client left: not a sign that Redis is down
                self._down(e)
            except (ValueError, TypeError) as e:  # not our scripts' answer: decide locally
                log.warning("redis answered a malformed decision for %s (%s)", scope, e)
            finally:
                if share:
                    leases.asked(scope)
        return self.fallback.reserve_now(scope, limits, tokens)

    async def _shielded(
        self, call: Awaitable[list[bytes]], scope: str, limits: Limits, tokens: float
    ) -> list[bytes]:
        """A reservation that asks for a lease runs to its end even if its caller is
        cancelled (the client left): what it took, the lease's units and the request's own,
        then goes back to Redis instead of staying out of the buckets until they refill."""
        fut = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: self._undo(f, scope, limits, tokens))
            raise

    def _undo(
        self, f: asyncio.Future[list[bytes]], scope: str, limits: Limits, tokens: float
    ) -> None:
        if f.cancelled() or f.exception() is not None:
            return
        try:
            d, lease_r, lease_t = _decision(f.result(), tokens)
        except (ValueError, TypeError):
            return
        if d.wait == 0.0 and self.healthy:
            self._queue_give(scope, limits, 1.0 + max(0.0, lease_r), tokens + max(0.0, lease_t))

    def _lease_left(self, scope: str, limits: Limits, requests: float, tokens: float) -> None:
        """What a lease left, to Redis with the flush's next batch (Redis down: dropped, with
        the shared buckets it belongs to)."""
        if self.healthy:
            self._queue_give(scope, limits, requests, tokens)

    async def learn(
        self,
        scope: str,
        limits: Limits,
        remaining_requests: float | None,
        remaining_tokens: float | None,
        since: Decision | None,
    ) -> None:
        """Queued once the store is started, and sent with the corrections (`give`) by the
        flush task: an answer's levels are learned off its first token's path, which waited
        a round trip to Redis for them. When the script runs does not change what it sets:
        it counts from `since`, the reservations made after it subtracted in Redis."""
        # Only finite levels go to Redis (the parser bounds them; this is the last gate).
        remaining_requests, remaining_tokens = finite(remaining_requests), finite(remaining_tokens)
        # This replica's lease ends here: the level learned counts its units as sent after
        # `since`; what it left goes back in the same script, so the level is what was stated
        # less what was really sent after `since` (another replica's lease: within LEASE_S).
        back_r, back_t = self._leases.end(scope)
        if self.healthy:
            args: list[str | float] = [
                *_spec_args(limits),
                "" if remaining_requests is None else remaining_requests,
                "" if remaining_tokens is None else remaining_tokens,
                since.seq_requests if since else 0.0,
                since.seq_tokens if since else 0.0,
                since.origin if since else 0,
                back_r,
                back_t,
            ]
            if self._tasks:  # started: the flush task sends it
                self._pending.append((self._learn, scope, args))
                self._flush_now.set()
                return
            try:
                await self._learn(keys=[self._key(scope)], args=args)
                return
            except (TimeoutError, RedisError, OSError) as e:
                _reraise_cancel()
                self._down(e)
        self.fallback.learn_now(scope, limits, remaining_requests, remaining_tokens, since)

    async def pause(self, scope: str, seconds: float) -> None:
        seconds = min(seconds, MAX_PAUSE) if seconds > 0 else 0.0  # NaN: no pause
        self.fallback.pause_now(scope, seconds)  # kept locally too, for a fallback to honour
        self._leases.release(scope)  # its lease grants nothing more
        if self.healthy:
            try:
                await self._pause(keys=[self._key(scope)], args=[seconds])
            except (TimeoutError, RedisError, OSError) as e:
                _reraise_cancel()
                self._down(e)

    def give(self, scope: str, limits: Limits, requests: float, tokens: float) -> None:
        if self._leases.give(scope, limits, requests, tokens):  # back with the lease
            return
        if not self.healthy:
            self.fallback.give(scope, limits, requests, tokens)
            return
        self._queue_give(scope, limits, requests, tokens)

    def _queue_give(self, scope: str, limits: Limits, requests: float, tokens: float) -> None:
        """Queued for the flush task; added to the last queued item when that is a give to
        the same scope's buckets (a burst's corrections: one script, not one each). Only
        the last: a give does not move past a learned level, which it would change."""
        args: list[str | float] = [*_spec_args(limits), requests, tokens]
        if self._pending:
            script, last_scope, last = self._pending[-1]
            if script is self._give and last_scope == scope and last[:4] == args[:4]:
                last[4] = float(last[4]) + requests
                last[5] = float(last[5]) + tokens
                return
        self._pending.append((self._give, scope, args))
        self._flush_now.set()

    # -- background: corrections, heartbeats, reconnection -------------------------------

    async def _flush(self) -> None:
        while True:
            await self._flush_now.wait()
            self._flush_now.clear()
            batch = list(self._pending)
            self._pending.clear()
            if batch and self.healthy:
                await self._send(batch)
            if self._closing and not self._pending:  # (what came during the send: once more)
                return

    async def _send(self, batch: list[tuple[AsyncScript, str, list[str | float]]]) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for script, scope, args in batch:
                    await script(keys=[self._key(scope)], args=args, client=pipe)
                await pipe.execute()
        except (TimeoutError, RedisError, OSError) as e:
            _reraise_cancel()
            self._down(e)

    async def _watch(self) -> None:
        key = f"{self.prefix}:replicas"
        while True:
            try:
                now = time.time()
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.zadd(key, {self.replica_id: now})
                    pipe.zremrangebyscore(key, "-inf", now - REPLICA_TTL)
                    pipe.zcard(key)
                    pipe.expire(key, int(REPLICA_TTL * 4))
                    res = await pipe.execute()
                self.replicas = max(1, int(res[2]))
                if not self.healthy:
                    self.healthy = True
                    metrics.LIMITS_FALLBACK.set(0)
                    log.warning(
                        "redis reachable again: limits are shared again (%d replicas)",
                        self.replicas,
                    )
            except (TimeoutError, RedisError, OSError) as e:
                _reraise_cancel()
                self._down(e)
            await asyncio.sleep(RETRY)

    async def start(self) -> None:
        metrics.LIMITS_FALLBACK.set(0)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch()), loop.create_task(self._flush())]

    async def close(self) -> None:
        self._leases.release_all()  # what leases left goes back now
        if self._tasks:
            # The flush task sends what is queued and returns (cancelled inside a pipeline,
            # redis-py may swallow the cancel); the heartbeat stops now. Bounded either way.
            self._closing = True
            self._flush_now.set()
            self._tasks[0].cancel()
            _, stuck = await asyncio.wait(self._tasks, timeout=2 * self.timeout + 1.0)
            for t in stuck:
                t.cancel()
            self._tasks = []
        elif self._pending and self.healthy:
            await self._send(list(self._pending))
        try:
            await self.redis.zrem(f"{self.prefix}:replicas", self.replica_id)
        except (TimeoutError, RedisError, OSError):
            pass
        await self.redis.aclose()
