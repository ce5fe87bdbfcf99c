"""Adaptive concurrency: additive increase, multiplicative decrease (AIMD).

Why AIMD and not a latency gradient (Gradient2, Envoy's adaptive concurrency): an LLM
request's latency is set mostly by its prompt and output length, which vary tenfold between
requests, and a provider queues out of sight, so a TTFT gradient mistakes long prompts for
overload. The signals that do mean "too much" are explicit: 429, 503 (529) and timeouts. AIMD
reacts to exactly those and is stable with many independent clients (TCP's argument).

Rule, per request: a drop (429/503/timeout) multiplies the limit by `backoff`, at most once
per `cooldown` seconds so one burst of 429s from requests sent together counts as one
signal; a success while at least half the limit was in use adds 1 (as in Netflix's AIMD), so
the limit follows demand up within about one round of requests. The limiter counts a success
when the upstream answers 200 (its headers), not when the stream ends: a cold burst above
the limit waits for the first answers (milliseconds), not for whole streams (seconds).

Slow start (`slow_start=True`, the gateway's limits): until the upstream's first drop, a
success adds 2, not 1. Streams outlive their first answer, so each request gives one sample,
and only those sent with half the limit in use count: with +1 a cold burst from 32 got 17
more requests through per round of time-to-headers (a burst of 1,000 waited ~57 rounds),
with +2 twice as many each round (34, 68, 136, ...: 5 rounds), as TCP's slow start doubles
its window; the half-in-use rule still bounds the limit to about twice what is in flight.
The first drop ends it, and the limit falls by half, the last round's doubling, but not
below the plain decrease of the initial limit (a drop before any growth costs what it did
without slow start).

Opening (`open`): doubling per round of answers is for an upstream whose limits are out of
sight (a provider that publishes no quota: the probe finds it at 2x its limit, not 30x). For
the others the limiter opens at the first answer: the limit goes to the maximum and the rest
of a cold burst goes out at once (limiter.py says which upstreams). A round of answers is
short on the wire but not on a busy gateway: in a burst of 1,000 streams the answers wait in
the event loop's queue behind the burst's own requests, and 96% of the burst waited for the
limit, 97 s summed (`benchmarks/burst.py`). After opening, the first drop falls to half of
what was in flight when the dropped request was sent (TCP's ssthresh after a loss: half the
flight size), since half the maximum says nothing about the upstream.

A full upstream (`cap`): a 503 or 529 refusal while the upstream holds streams it accepted
says how many it can hold, so the limit falls to that count at once (not below the minimum)
and slow start ends; no multiplicative drop is taken off that count (the limiter does not
sample the refused request: the cap is the measurement). Without it a cold burst grows
the limit past an upstream's fixed slots within one round and every request sent above them
is refused until the multiplicative decreases (one per `cooldown`) catch up. Once capped, a
success adds 1/limit, not 1: the limit probes one slot per round of answers (TCP's
congestion avoidance). With +1 a full upstream's every stream end grew the limit past its
slots again, and a 1,000-stream burst on 200 slots was refused 710 times (burst.py
--sim-max-active 200). A cap is a lower bound: the answers of requests still on their way
may show the upstream holding more (`holds`), and then the limit rises to that at once.
"""

from __future__ import annotations

from tokenpipe.clock import MONOTONIC, Clock


class AIMDLimit:
    __slots__ = (
        "_last_drop",
        "backoff",
        "capped",
        "clock",
        "cooldown",
        "initial",
        "limit",
        "maximum",
        "minimum",
        "opened",
        "slow_start",
    )

    def __init__(
        self,
        initial: float = 32,
        *,
        minimum: float = 1,
        maximum: float = 1024,
        backoff: float = 0.9,
        cooldown: float = 1.0,
        clock: Clock = MONOTONIC,
        slow_start: bool = False,
    ) -> None:
        self.limit = float(initial)  # requests in flight
        self.initial = self.limit
        self.minimum = float(minimum)
        self.maximum = float(maximum)
        self.backoff = backoff  # share kept on a drop
        self.cooldown = cooldown  # seconds between two decreases
        self.clock = clock
        self.slow_start = slow_start  # until the first drop (module doc)
        self._last_drop = -float("inf")
        self.capped = False  # a full upstream was seen: growth is one per round (`cap`)
        self.opened = False  # slow start went to the maximum at once (`open`)

    def sample(self, inflight: int, dropped: bool) -> float:
        """Records one finished request (`inflight`: how many were in flight at its start)."""
        if dropped:
            now = self.clock.now()
            if now - self._last_drop >= self.cooldown:
                self._last_drop = now
                kept = self.limit * self.backoff
                if self.slow_start:
                    self.slow_start = False
                    flight = min(self.limit, inflight) if self.opened else self.limit
                    kept = min(kept, max(flight / 2, self.initial * self.backoff))
                self.limit = max(self.minimum, kept)
        elif inflight * 2 >= self.limit:
            step = 2.0 if self.slow_start else (1.0 / self.limit if self.capped else 1.0)
            self.limit = min(self.maximum, self.limit + step)
        return self.limit

    def open(self) -> float:
        """The upstream's first answer says it needs no probing (module doc): in slow start,
        the limit goes to the maximum at once. A drop or a full upstream later lowers it."""
        if self.slow_start:
            self.opened = True
            self.limit = self.maximum
        return self.limit

    def cap(self, accepted: int) -> float:
        """The upstream refused a request while holding `accepted` others: it is full there."""
        self.slow_start = False
        self.capped = True
        self.limit = max(self.minimum, min(self.limit, float(accepted)))
        return self.limit

    def holds(self, accepted: int) -> float:
        """The upstream answered 200 while holding `accepted` streams: once capped, the
        limit is at least that (it can take them)."""
        if self.capped and accepted > self.limit:
            self.limit = min(self.maximum, float(accepted))
        return self.limit

    def allows(self, inflight: int) -> bool:
        return inflight < int(self.limit)
