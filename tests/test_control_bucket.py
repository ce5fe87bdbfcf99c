"""TokenBucket as the limiter uses it: reservations, debt, corrections, learned levels."""

from __future__ import annotations

import math

from tokenpipe.clock import ManualClock
from tokenpipe.control.bucket import MAX_DEBT, TokenBucket


def test_bucket_refills_continuously_up_to_capacity() -> None:
    clock = ManualClock()
    b = TokenBucket(rate=10, capacity=20, clock=clock)
    assert b.take(20) == 0.0
    clock.advance(0.5)
    assert math.isclose(b.level, 5)
    clock.advance(100)
    assert b.level == 20


def test_take_refuses_and_says_how_long_until_enough() -> None:
    clock = ManualClock()
    b = TokenBucket(rate=10, capacity=20, clock=clock, level=2)
    assert math.isclose(b.take(5), 0.3)
    assert math.isclose(b.level, 2)  # nothing taken
    assert b.take(21) == math.inf


def test_reservation_larger_than_the_bucket_runs_once_full_and_leaves_debt() -> None:
    clock = ManualClock()
    b = TokenBucket(rate=10, capacity=20, clock=clock)
    assert b.reserve(50) == 0.0  # admitted at a full bucket although 50 > 20
    assert math.isclose(b.level, -30)
    # The debt is paid by waiting: the next single unit needs 31 units of refill.
    assert math.isclose(b.wait_for(1), 3.1)
    clock.advance(3.1)
    assert b.reserve(1) == 0.0


def test_give_corrects_a_reservation_both_ways_within_capacity() -> None:
    clock = ManualClock()
    b = TokenBucket(rate=1, capacity=100, clock=clock)
    b.reserve(60)
    b.give(25)  # cost less than reserved
    assert math.isclose(b.level, 65)
    b.give(-15)  # cost more
    assert math.isclose(b.level, 50)
    b.give(1000)
    assert b.level == 100


def test_set_level_and_configure_take_what_the_upstream_says() -> None:
    clock = ManualClock()
    b = TokenBucket(rate=1, capacity=100, clock=clock)
    b.set_level(7)
    assert b.level == 7
    b.configure(rate=10, capacity=5)
    assert b.level == 5  # clipped to the new depth
    b.take(5)
    clock.advance(0.2)
    assert math.isclose(b.level, 2)  # new rate applies


def test_commit_charges_what_wait_for_admitted_and_held_is_the_level_then() -> None:
    """The store checks every bucket (wait_for), then charges each (commit) and reports its
    level (held) in the same step: the charge stops at the debt floor, and held is the level
    as of the last refill, until the next refill moves it on."""
    clock = ManualClock()
    b = TokenBucket(rate=1.0, capacity=10.0, clock=clock)
    assert b.wait_for(4.0) == 0.0
    b.commit(4.0)
    assert b.held == 6.0
    clock.advance(2.0)
    assert b.held == 6.0  # no refill yet
    assert b.level == 8.0  # refilled now
    b.commit(1000.0)  # debt stops at MAX_DEBT depths
    assert b.held == -MAX_DEBT * 10.0
    b.configure(rate=1.0, capacity=5.0)
    b.commit(1000.0)
    assert b.held == -MAX_DEBT * 5.0  # the floor follows the new depth
