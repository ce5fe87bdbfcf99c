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


def _rounds(a: AIMDLimit, n: int) -> list[int]:
    """Requests let through per round of answers for a burst that fills every permit: the
    k-th request sent had k in flight when it started (streams outlive their answer), and
    each round the requests sent in the one before are answered (200)."""
    answered, sent, let_through = 0, int(a.limit), []
    for _ in range(n):
        for k in range(answered + 1, sent + 1):
            a.sample(inflight=k, dropped=False)
        answered, sent = sent, int(a.limit)
        let_through.append(sent - answered)
    return let_through


def test_slow_start_doubles_each_round_of_answers_until_the_first_drop() -> None:
    assert _rounds(AIMDLimit(32, maximum=4096, clock=ManualClock()), 4) == [17] * 4  # plain
    a = AIMDLimit(32, maximum=4096, clock=ManualClock(), slow_start=True)
    assert _rounds(a, 4) == [34, 68, 136, 272]
    assert a.limit == 542
    a.sample(inflight=500, dropped=True)
    assert a.limit == 271 and not a.slow_start  # the last doubling undone
    a.sample(inflight=271, dropped=False)
    assert a.limit == 272  # additive from here on


def test_a_drop_before_slow_start_grew_costs_what_the_plain_rule_takes() -> None:
    a = AIMDLimit(32, clock=ManualClock(), slow_start=True, backoff=0.9)
    a.sample(inflight=10, dropped=True)
    assert a.limit == 32 * 0.9


def test_slow_start_leaves_an_idle_upstream_alone() -> None:
    a = AIMDLimit(10, clock=ManualClock(), slow_start=True)
    for _ in range(100):
        a.sample(inflight=2, dropped=False)
    assert a.limit == 10


def test_an_opened_limit_falls_to_half_the_flight_at_its_first_drop() -> None:
    """After `open` half the maximum says nothing of the upstream; half of what was in
    flight when the dropped request was sent does (TCP's ssthresh)."""
    a = AIMDLimit(32, maximum=1024, clock=ManualClock(), slow_start=True)
    assert a.open() == 1024 and a.allows(1023)
    a.sample(inflight=300, dropped=True)
    assert a.limit == 150 and not a.slow_start
    assert a.open() == 150  # slow start is over: nothing opens it again
    b = AIMDLimit(32, maximum=1024, clock=ManualClock(), slow_start=True)
    b.open()
    b.sample(inflight=5, dropped=True)
    assert b.limit == 32 * 0.9  # not below the plain decrease of the initial limit


def test_a_full_upstream_caps_the_limit_at_what_it_holds_and_growth_slows_to_one_a_round() -> None:
    a = AIMDLimit(32, clock=ManualClock(), slow_start=True)
    for _ in range(100):  # a cold burst doubles the limit round by round
        a.sample(inflight=int(a.limit), dropped=False)
    assert a.limit == 232
    assert a.cap(200) == 200 and not a.slow_start  # refused while holding 200
    assert a.cap(210) == 200  # a cap never raises the limit
    for _ in range(200):  # one round of answers at the cap: one more slot, not 200
        a.sample(inflight=200, dropped=False)
    assert 200.9 < a.limit < 201.1
    assert a.holds(205) == 205  # answers still on their way show it holds more
    assert a.holds(100) == 205


def test_holding_streams_raises_only_a_capped_limit() -> None:
    a = AIMDLimit(10, clock=ManualClock())
    assert a.holds(50) == 10  # no cap seen: the ordinary rule alone
