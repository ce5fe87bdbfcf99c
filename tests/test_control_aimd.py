"""AIMD concurrency limit with an injected clock."""

from __future__ import annotations

from tokenpipe.clock import ManualClock
from tokenpipe.control.aimd import AIMDLimit


def test_successes_under_load_grow_the_limit_by_one_each() -> None:
    a = AIMDLimit(10, maximum=12, clock=ManualClock())
    a.sample(inflight=9, dropped=False)
    assert a.limit == 11
    for _ in range(5):
        a.sample(inflight=9, dropped=False)
    assert a.limit == 12  # capped


def test_an_idle_upstream_does_not_inflate_the_limit() -> None:
    a = AIMDLimit(10, clock=ManualClock())
    for _ in range(100):
        a.sample(inflight=2, dropped=False)
    assert a.limit == 10


def test_a_burst_of_drops_counts_once_per_cooldown() -> None:
    clock = ManualClock()
    a = AIMDLimit(100, backoff=0.5, cooldown=1.0, clock=clock)
    for _ in range(20):  # twenty 429s from requests sent together
        a.sample(inflight=90, dropped=True)
    assert a.limit == 50
    clock.advance(1.0)
    a.sample(inflight=40, dropped=True)
    assert a.limit == 25


def test_the_limit_never_falls_below_the_minimum() -> None:
    clock = ManualClock()
    a = AIMDLimit(2, minimum=1, backoff=0.1, cooldown=0, clock=clock)
    a.sample(1, True)
    a.sample(1, True)
    assert a.limit == 1 and a.allows(0) and not a.allows(1)
