"""MemoryStore: reservations over two buckets, learning with in-flight correction, pauses,
and the per-process share of `serve --workers`."""

from __future__ import annotations

import math

from tokenpipe.clock import ManualClock
from tokenpipe.control.store import Limits, MemoryStore, Spec

LIMITS = Limits(requests=Spec(rate=10, capacity=20), tokens=Spec(rate=100, capacity=1000))


def test_a_request_is_granted_only_when_both_buckets_allow_it() -> None:
    clock = ManualClock()
    s = MemoryStore(clock)
    assert s.reserve_now("up:a", LIMITS, 900).wait == 0.0
    d = s.reserve_now("up:a", LIMITS, 300)  # requests are plenty, tokens are not
    assert math.isclose(d.wait, 2.0)  # (300 - 100) tokens at 100/s
    assert d.remaining_requests is not None and math.isclose(d.remaining_requests, 19)
    clock.advance(2.0)
    assert s.reserve_now("up:a", LIMITS, 300).wait == 0.0


def test_upstream_headers_are_corrected_by_what_was_sent_after_them() -> None:
    s = MemoryStore(ManualClock())
    first = s.reserve_now("up:a", LIMITS, 10)
    s.reserve_now("up:a", LIMITS, 10)
    s.reserve_now("up:a", LIMITS, 10)
    # The answer to the first request says 12 requests / 500 tokens were left then; two more
    # were sent since, which the upstream had not counted yet.
    s.learn_now("up:a", LIMITS, 12, 500, first)
    d = s.reserve_now("up:a", LIMITS, 0)
    assert d.remaining_requests is not None and math.isclose(d.remaining_requests, 12 - 2 - 1)
    assert d.remaining_tokens is not None and math.isclose(d.remaining_tokens, 500 - 20)


def test_a_pause_holds_every_request_until_it_ends() -> None:
    clock = ManualClock()
    s = MemoryStore(clock)
    s.pause_now("up:a", 1.5)
    assert math.isclose(s.reserve_now("up:a", LIMITS, 1).wait, 1.5)
    clock.advance(1.5)
    assert s.reserve_now("up:a", LIMITS, 1).wait == 0.0


def test_a_worker_share_holds_its_part_of_every_limit() -> None:
    clock = ManualClock()
    s = MemoryStore(clock, share=1 / 4)  # one of four workers: 5 of the 20 deep bucket
    granted = sum(s.reserve_now("up:a", LIMITS, 1).wait == 0.0 for _ in range(20))
    assert granted == 5
    clock.advance(1.0)  # 2.5 requests/s for this worker
    granted = sum(s.reserve_now("up:a", LIMITS, 1).wait == 0.0 for _ in range(20))
    assert granted == 2


def test_giving_back_an_unused_reservation_frees_it_at_once() -> None:
    s = MemoryStore(ManualClock())
    one = Limits(requests=Spec(rate=0.001, capacity=1))
    assert s.reserve_now("up:a", one, 0).wait == 0.0
    assert s.reserve_now("up:a", one, 0).wait > 0
    s.give("up:a", one, 1.0, 0.0)
    assert s.reserve_now("up:a", one, 0).wait == 0.0


def test_new_limits_for_a_scope_refit_its_buckets_at_once() -> None:
    # The buckets are fitted once per Limits object (a scope's limits are the same object
    # from one request to the next); a new object, learned or configured, applies at once.
    clock = ManualClock()
    s = MemoryStore(clock)
    one = Limits(requests=Spec(rate=0.001, capacity=1))
    assert s.reserve_now("up:a", one, 0).wait == 0.0
    assert s.reserve_now("up:a", one, 0).wait > 0  # the same object: the bucket is spent
    faster = Limits(requests=Spec(rate=10, capacity=1))
    assert s.reserve_now("up:a", faster, 0).wait > 0  # still spent (configure keeps levels)
    clock.advance(0.1)  # one request at 10/s (at 0.001/s it would take 1,000 s)
    assert s.reserve_now("up:a", faster, 0).wait == 0.0
    assert s.reserve_now("up:a", Limits(), 0).wait == 0.0  # unlimited now: never waits
    assert s.reserve_now("up:a", one, 0).wait == 0.0  # a new bucket, full
