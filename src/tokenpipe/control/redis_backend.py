"""Buckets shared by every gateway replica through Redis.

Each decision is one server-side Lua script (one round trip, atomic): refill from Redis'
own clock (`TIME`, so replicas need no synchronised clocks), check the pause and both
buckets, take the reservation. Learning from headers, pauses and corrections are scripts too.

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

from redis import asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control.bounds import MAX_PAUSE, finite
from tokenpipe.control.bucket import MAX_DEBT
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
#: Scope keys expire after a day without traffic (seconds).
KEY_TTL = 86_400

# Times inside Redis are seconds since this offset, so a double keeps microseconds when
# Lua turns it into a string (%.14g).
_NOW = """
local t = redis.call('TIME')
local now = (tonumber(t[1]) - 1700000000) + tonumber(t[2]) / 1000000
-- What another replica wrote may be garbage, NaN or infinite (hostile or older code):
-- every field read is checked and bounded as the local buckets are.
local function num(x, default)
  x = tonumber(x)
  if x == nil or x ~= x or x == math.huge or x == -math.huge then return default end
  return x
end
local function level(l, u, rate, cap)
  l = num(l, nil)
  if l == nil or l >= cap then return cap end
  l = math.max(-MAX_DEBT * cap, l)
  return math.min(cap, l + math.max(0, now - num(u, now)) * rate)
end
local rr, rc, tr, tc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local h = redis.call('HMGET', KEYS[1], 'rl', 'ru', 'tl', 'tu', 'rs', 'ts', 'pu', 'ep')
local ep = h[8]
if not ep or not string.match(ep, '^%d+$') or string.len(ep) > 18 then
  ep = string.format('%d', math.floor(now * 1000000))
  redis.call('HSET', KEYS[1], 'ep', ep)
end
local rl, tl = nil, nil
if rr > 0 then rl = level(h[1], h[2], rr, rc) end
if tr > 0 then tl = level(h[3], h[4], tr, tc) end
local rs, ts = num(h[5], 0), num(h[6], 0)
"""
_SAVE = """
if rl then redis.call('HSET', KEYS[1], 'rl', rl, 'ru', now) end
if tl then redis.call('HSET', KEYS[1], 'tl', tl, 'tu', now) end
redis.call('EXPIRE', KEYS[1], KEY_TTL)
""".replace("KEY_TTL", str(KEY_TTL))

# ARGV: rr rc tr tc tokens -> {wait, rs, ts, rl, tl, ep}
RESERVE = (
    _NOW
    + """
local n = tonumber(ARGV[5])
local wait = 0
local pu = num(h[7], 0)
if pu > now + MAX_PAUSE then
  pu = now + MAX_PAUSE
  redis.call('HSET', KEYS[1], 'pu', pu)
end
if pu > now then wait = pu - now end
if rl and rl < 1 then wait = math.max(wait, (1 - rl) / rr) end
if tl then
  local need = math.min(n, tc)
  if tl < need then wait = math.max(wait, (need - tl) / tr) end
end
if wait == 0 then
  rs = rs + 1
  ts = ts + n
  if rl then rl = math.max(-MAX_DEBT * rc, rl - 1) end
  if tl then tl = math.max(-MAX_DEBT * tc, tl - n) end
  redis.call('HSET', KEYS[1], 'rs', rs, 'ts', ts)
end
"""
    + _SAVE
    + """
return {tostring(wait), tostring(rs), tostring(ts), tostring(rl or ''), tostring(tl or ''), ep}
"""
)

# ARGV: rr rc tr tc remaining_r remaining_t seq_r seq_t ep ('' = unknown)
LEARN = (
    _NOW
    + """
local same = tonumber(ARGV[9]) == tonumber(ep)
if rl and ARGV[5] ~= '' then
  local after = 0
  if same then after = rs - tonumber(ARGV[7]) end
  rl = math.max(-MAX_DEBT * rc, math.min(rc, tonumber(ARGV[5]) - after))
end
if tl and ARGV[6] ~= '' then
  local after = 0
  if same then after = ts - tonumber(ARGV[8]) end
  tl = math.max(-MAX_DEBT * tc, math.min(tc, tonumber(ARGV[6]) - after))
end
"""
    + _SAVE
    + """
return 1
"""
)

# ARGV: rr rc tr tc requests tokens (units given back; negative charges)
GIVE = (
    _NOW
    + """
if rl then rl = math.max(-MAX_DEBT * rc, math.min(rc, rl + tonumber(ARGV[5]))) end
if tl then tl = math.max(-MAX_DEBT * tc, math.min(tc, tl + tonumber(ARGV[6]))) end
"""
    + _SAVE
    + """
return 1
"""
)

# ARGV: seconds
PAUSE = """
local t = redis.call('TIME')
local now = (tonumber(t[1]) - 1700000000) + tonumber(t[2]) / 1000000
local pu = tonumber(redis.call('HGET', KEYS[1], 'pu')) or 0
if pu ~= pu then pu = 0 end
local s = math.min(tonumber(ARGV[1]), MAX_PAUSE)
redis.call('HSET', KEYS[1], 'pu', math.min(math.max(pu, now + s), now + MAX_PAUSE))
redis.call('EXPIRE', KEYS[1], KEY_TTL)
return 1
"""


def _bounded(script: str) -> str:
    """The script with the bounds shared with the local buckets filled in."""
    for name, value in (("MAX_DEBT", MAX_DEBT), ("MAX_PAUSE", MAX_PAUSE), ("KEY_TTL", KEY_TTL)):
        script = script.replace(name, repr(value))
    return script


RESERVE, LEARN, GIVE, PAUSE = (_bounded(x) for x in (RESERVE, LEARN, GIVE, PAUSE))


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


def _decision(res: list[bytes]) -> Decision:
    """RESERVE's answer, checked: a malformed one raises ValueError (never a NaN wait)."""
    wait, rs, ts, rl, tl, ep = res
    w = _num(wait) or 0.0
    if w < 0:
        raise ValueError("negative wait")
    return Decision(w, _num(rs) or 0.0, _num(ts) or 0.0, _num(rl), _num(tl), int(ep))


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
        self._tasks: list[asyncio.Task[None]] = []

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
        if self.healthy:
            try:
                res = await self._reserve(
                    keys=[self._key(scope)], args=[*_spec_args(limits), tokens]
                )
                return _decision(res)
            except (TimeoutError, RedisError, OSError) as e:
                self._down(e)
            except (ValueError, TypeError) as e:  # not our scripts' answer: decide locally
                log.warning("redis answered a malformed decision for %s (%s)", scope, e)
        return self.fallback.reserve_now(scope, limits, tokens)

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
        if self.healthy:
            args: list[str | float] = [
                *_spec_args(limits),
                "" if remaining_requests is None else remaining_requests,
                "" if remaining_tokens is None else remaining_tokens,
                since.seq_requests if since else 0.0,
                since.seq_tokens if since else 0.0,
                since.origin if since else 0,
            ]
            if self._tasks:  # started: the flush task sends it
                self._pending.append((self._learn, scope, args))
                self._flush_now.set()
                return
            try:
                await self._learn(keys=[self._key(scope)], args=args)
                return
            except (TimeoutError, RedisError, OSError) as e:
                self._down(e)
        self.fallback.learn_now(scope, limits, remaining_requests, remaining_tokens, since)

    async def pause(self, scope: str, seconds: float) -> None:
        seconds = min(seconds, MAX_PAUSE) if seconds > 0 else 0.0  # NaN: no pause
        self.fallback.pause_now(scope, seconds)  # kept locally too, for a fallback to honour
        if self.healthy:
            try:
                await self._pause(keys=[self._key(scope)], args=[seconds])
            except (TimeoutError, RedisError, OSError) as e:
                self._down(e)

    def give(self, scope: str, limits: Limits, requests: float, tokens: float) -> None:
        if not self.healthy:
            self.fallback.give(scope, limits, requests, tokens)
            return
        self._pending.append((self._give, scope, [*_spec_args(limits), requests, tokens]))
        self._flush_now.set()

    # -- background: corrections, heartbeats, reconnection -------------------------------

    async def _flush(self) -> None:
        while True:
            await self._flush_now.wait()
            self._flush_now.clear()
            batch = list(self._pending)
            self._pending.clear()
            if not batch or not self.healthy:
                continue
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for script, scope, args in batch:
                        await script(keys=[self._key(scope)], args=args, client=pipe)
                    await pipe.execute()
            except (TimeoutError, RedisError, OSError) as e:
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
                self._down(e)
            await asyncio.sleep(RETRY)

    async def start(self) -> None:
        metrics.LIMITS_FALLBACK.set(0)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch()), loop.create_task(self._flush())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        self._tasks = []
        try:
            await self.redis.zrem(f"{self.prefix}:replicas", self.replica_id)
        except (TimeoutError, RedisError, OSError):
            pass
        await self.redis.aclose()
