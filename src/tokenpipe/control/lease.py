"""Units a replica took from a scope's shared buckets in one round trip to Redis, to grant
its next requests without one (`redis_backend.RedisStore`).

A decision through Redis costs the caller a round trip before its request is sent, and
redis-py's client ~170 us of this process' CPU (hiredis parsing its answers): more than the
rest of a 1-token request (benchmarks/request_instructions.py --redis: 1,574k instructions
a request against 768k with the buckets in the process). So while a scope's buckets are far
from their limits, the reservation that asks Redis also takes a lease: a share of what is
above `redis_scripts.LEASE_ABOVE` of each bucket, reserved in Redis as sent requests are.
The replica's next requests are granted from it, in the process, until it is spent or
LEASE_S has passed; then the next request asks Redis again and gives back what is left.

What this keeps and what it gives up:
- Nothing is granted twice: a lease's units are taken from the shared buckets before any of
  them is used, so the replicas together never grant more than the buckets hold. A replica
  leases at most 1/(2N) of what is above the line (N: the live replicas, from heartbeats),
  so one busy replica cannot take what the others need.
- Near a limit (a bucket below LEASE_ABOVE of its capacity after the reservation) there is
  no lease: every request asks Redis, as before.
- What other replicas learn (a 429's pause, levels from headers) reaches a replica holding a
  lease when it next asks Redis: within LEASE_S (50 ms), the window within which the
  limiter already reads an answer's headers (`levels.LEARN_EVERY_S`). Its own 429 ends its
  lease at once (`RedisStore.pause`).
- Units left in a lease are back in Redis at most LEASE_S after it was taken (held, not
  lost); corrections to a request's tokens made while a lease is held go into the lease.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from tokenpipe.clock import Clock
from tokenpipe.control.store import Decision, Limits

#: Seconds a lease may grant requests; then its units left go back to Redis.
LEASE_S = 0.05
#: Requests one lease holds at most (~50 ms of a busy process: ~2,500 requests a second).
LEASE_MAX_REQUESTS = 128


class Lease:
    """One scope's lease: what is left of its units (math.inf for a bucket not limited), the
    sequence numbers its grants carry, and the levels Redis had when it was taken."""

    __slots__ = (
        "level_requests",
        "level_tokens",
        "limits",
        "origin",
        "requests",
        "seq_requests",
        "seq_tokens",
        "timer",
        "tokens",
        "until",
    )

    def __init__(
        self, limits: Limits, granted: Decision, requests: float, tokens: float, until: float
    ) -> None:
        """`granted`: the decision of the request that took it (its own sequence numbers,
        the levels with the lease still in them); `requests`, `tokens`: the units leased."""
        #: The Limits it was taken under: another (learned from headers) ends it.
        self.limits = limits
        self.requests = requests if limits.requests is not None else math.inf
        self.tokens = tokens if limits.tokens is not None else math.inf
        # Its units follow the granted request in the scope's count: (seq, seq + units].
        self.seq_requests = granted.seq_requests
        self.seq_tokens = granted.seq_tokens
        # The levels without the lease: a grant reports them with what the lease has left.
        r, t = granted.remaining_requests, granted.remaining_tokens
        self.level_requests = None if r is None else r - requests
        self.level_tokens = None if t is None else t - tokens
        self.origin = granted.origin
        self.until = until  # the store's clock
        self.timer: asyncio.TimerHandle | None = None

    def take(self, tokens: float) -> Decision | None:
        """A grant of one request of `tokens`, or None when the lease does not hold it."""
        if self.requests < 1.0 or self.tokens < tokens:
            return None
        self.requests -= 1.0
        self.tokens -= tokens
        self.seq_requests += 1.0
        self.seq_tokens += tokens
        return Decision(
            0.0,
            self.seq_requests,
            self.seq_tokens,
            None if self.level_requests is None else self.level_requests + self.requests,
            None if self.level_tokens is None else self.level_tokens + self.tokens,
            self.origin,
        )

    def give(self, requests: float, tokens: float) -> None:
        """Units given back (negative: charged) while the lease is held."""
        self.requests += requests
        self.tokens += tokens

    def left(self) -> tuple[float, float]:
        """What goes back to Redis: the units left of each limited bucket (negative when
        charged past them), 0 for one not limited."""
        return (
            self.requests if self.limits.requests is not None else 0.0,
            self.tokens if self.limits.tokens is not None else 0.0,
        )


#: Leases a request waits for, one after another, before it asks Redis itself (a burst
#: that spends each lease as it lands; each wait is bounded by the asker's Redis timeouts).
LEASE_WAITS = 4
#: Leases held at once (one a scope: upstreams and API keys); past it the oldest goes back.
MAX_LEASES = 10_000


class Leases:
    """A store's leases, one a scope; the asks for one on their way; and the timers that
    give back what a lease left when no request asked Redis after it. `give_back(scope,
    limits, requests, tokens)` sends a lease's units left to Redis."""

    def __init__(
        self, clock: Clock, give_back: Callable[[str, Limits, float, float], None]
    ) -> None:
        self.clock = clock
        self._give_back = give_back
        self._held: dict[str, Lease] = {}  # at most MAX_LEASES
        self._asking: dict[str, asyncio.Future[None]] = {}  # done when the answer is in

    def take(self, scope: str, limits: Limits, tokens: float) -> Decision | None:
        """A grant from the scope's lease, or None (none held, over, for other limits, or
        it does not hold the request)."""
        lease = self._held.get(scope)
        if lease is not None and lease.limits is limits and self.clock.now() < lease.until:
            return lease.take(tokens)
        return None

    async def wait(self, scope: str, limits: Limits, tokens: float) -> Decision | None:
        """A grant from a lease that was on its way (a burst's requests would each ask
        Redis meanwhile); LEASE_WAITS in turn at most, then None."""
        for _ in range(LEASE_WAITS):
            asking = self._asking.get(scope)
            if asking is None:
                return None
            await asyncio.shield(asking)
            if (d := self.take(scope, limits, tokens)) is not None:
                return d
        return None

    def ask(self, scope: str) -> bool:
        """True: the caller asks for the scope's lease (none is on its way); it calls
        `asked` once the answer is in, whatever it was."""
        if scope in self._asking:
            return False
        self._asking[scope] = asyncio.get_running_loop().create_future()
        return True

    def asked(self, scope: str) -> None:
        self._asking.pop(scope).set_result(None)

    def hold(self, scope: str, lease: Lease) -> None:
        if scope in self._held:  # (a reserve ended it before asking; kept safe all the same)
            self.release(scope)
        elif len(self._held) >= MAX_LEASES:  # bound: the oldest goes back first
            self.release(next(iter(self._held)))
        self._held[scope] = lease
        lease.timer = asyncio.get_running_loop().call_later(LEASE_S, self._expire, scope, lease)

    def end(self, scope: str) -> tuple[float, float]:
        """Ends the scope's lease; what it left, for the caller to give back (0, 0: none)."""
        lease = self._held.pop(scope, None)
        if lease is None:
            return 0.0, 0.0
        if lease.timer is not None:
            lease.timer.cancel()
            lease.timer = None
        return lease.left()

    def release(self, scope: str) -> None:
        """Ends the scope's lease and gives back what it left."""
        lease = self._held.get(scope)
        if lease is not None:
            r, t = self.end(scope)
            if r or t:
                self._give_back(scope, lease.limits, r, t)

    def release_all(self) -> None:
        for scope in list(self._held):
            self.release(scope)

    def give(self, scope: str, limits: Limits, requests: float, tokens: float) -> bool:
        """Units given back (negative: charged) go into the scope's lease when one is held
        under these limits (True); they go back to Redis with it."""
        lease = self._held.get(scope)
        if lease is None or lease.limits is not limits:
            return False
        lease.give(requests, tokens)
        return True

    def _expire(self, scope: str, lease: Lease) -> None:
        """LEASE_S after it was taken, with no request since to ask Redis and give it back.
        The clock says when it ends (the timer only wakes this up): a test's clock that
        stands still keeps the lease."""
        lease.timer = None
        if self._held.get(scope) is not lease:
            return
        left = lease.until - self.clock.now()
        if left > 0.0:
            loop = asyncio.get_running_loop()
            lease.timer = loop.call_later(min(left, LEASE_S), self._expire, scope, lease)
        else:
            self.release(scope)
