"""Tail-latency control algorithms, driven by a ManualClock."""

from __future__ import annotations

import math
import random
import tracemalloc
from collections.abc import Callable

import pytest
from ddsketch import LogCollapsingLowestDenseDDSketch
from ddsketch.store import CollapsingLowestDenseStore as Store

from tokenpipe.clock import ManualClock
from tokenpipe.control.breaker import CircuitBreaker, State
from tokenpipe.control.budget import RatioBudget, backoff
from tokenpipe.control.deadline import AdaptiveDeadline
from tokenpipe.control.quantiles import ACCURACY, BINS, MAPPING, RollingQuantiles
from tokenpipe.dialects import CHAT, COMPLETIONS
from tokenpipe.router.policy import prompt_class


def test_rolling_quantiles_are_within_one_percent_of_the_exact_ones() -> None:
    clock = ManualClock()
    est = RollingQuantiles(60.0, clock=clock)
    rng = random.Random(1)
    values = [rng.lognormvariate(-3, 0.5) for _ in range(5000)]
    for v in values:
        est.add(v)
    clock.advance(1)  # past the cache refresh
    exact = sorted(values)
    for q in (0.5, 0.95, 0.99):
        want = exact[int(q * (len(exact) - 1))]
        got = est.quantile(q)
        assert got is not None and abs(got - want) / want < 0.02, (q, got, want)


@pytest.mark.parametrize("seed", range(20))
def test_rolling_quantiles_are_ddsketchs_own_over_the_window(seed: int) -> None:
    """The view's running totals give the quantile a DDSketch of the window's values gives
    (the same key, so the same value), as the window slides, slices close and expire."""
    clock = ManualClock()
    est = RollingQuantiles(60.0, slices=6, clock=clock)
    rng = random.Random(seed)
    added: list[tuple[int, float]] = []  # (slice number, value)
    for _ in range(rng.randint(1, 40)):
        clock.advance(rng.choice((0.01, 0.3, 4.0, 11.0, 25.0)))
        for _ in range(rng.randint(0, 60)):
            # within the bins' range (5 ms to 5 s): no store collapses, nor the merged one
            v = math.exp(rng.uniform(math.log(0.005), math.log(5.0)))
            est.add(v)
            added.append((int(clock.now() // 10.0), v))
        clock.advance(0.3)  # past the view's refresh
        now = int(clock.now() // 10.0)
        sketch = LogCollapsingLowestDenseDDSketch(ACCURACY, BINS)
        for n, v in added:
            if n > now - 6:
                sketch.add(v)
        assert est.count == sketch.count
        for q in (0.0, 0.25, 0.5, 0.9, 0.95, 0.99, 1.0):
            assert est.quantile(q) == sketch.get_quantile_value(q), (q, seed)


def test_a_value_is_keyed_as_ddsketchs_mapping_keys_it() -> None:
    """`add` computes the key inline; it must be the mapping's own, value by value."""
    est = RollingQuantiles(clock=ManualClock())
    rng = random.Random(3)
    values = [math.exp(rng.uniform(math.log(1e-6), math.log(1e4))) for _ in range(20_000)]
    values += [0.0, -1.0, 1e-9, 1e-6, 1.0, 2.0, 0.5]  # at and below the floor (1 us)
    for v in values:
        store = Store(BINS)
        store.add(MAPPING.key(max(v, 1e-6)))
        est._slices.clear()
        est.add(v)
        kept = est._slices[0][1]
        assert (kept.min_key, kept.bins) == (store.min_key, store.bins), v


def test_rolling_quantiles_forget_values_older_than_the_window() -> None:
    clock = ManualClock()
    est = RollingQuantiles(60.0, slices=6, clock=clock)
    for _ in range(100):
        est.add(5.0)  # a slow minute
    clock.advance(61)
    for _ in range(100):
        est.add(0.1)
    clock.advance(1)
    assert est.count == 100
    q = est.quantile(0.99)
    assert q is not None and q < 0.11
    clock.advance(120)
    assert est.count == 0 and est.quantile(0.5) is None


def test_an_estimate_of_widely_spread_values_stays_small_and_right_at_the_top() -> None:
    """A sketch kept a bin for every 1% step between its smallest and largest value: one
    value of 1 us and one of 300 s held ~1,000 bins a sketch, 92 KiB an estimator, up to
    4,096 estimators a table (a client's model names). Now each sketch keeps BINS."""
    clock = ManualClock()
    tracemalloc.start()
    try:
        est = RollingQuantiles(60.0, slices=6, clock=clock)
        for _ in range(6):  # every slice of the window, and the merged view
            for v in (1e-6, 300.0, 0.017):
                est.add(v)
            clock.advance(10)
        clock.advance(-9)
        top = est.quantile(0.99)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 60 * 1024, held  # 51 KiB; 92 KiB before
    assert top is not None and abs(top - 300.0) / 300.0 < 0.01
    assert est.quantile(0.5) == pytest.approx(0.017, rel=0.01)  # within the bins' range


def test_deadline_is_static_until_enough_samples_then_clamped_k_times_p99() -> None:
    clock = ManualClock()
    est = RollingQuantiles(clock=clock)
    rule = AdaptiveDeadline(k=1.5, floor=2.0, ceiling=10.0, initial=7.0, min_samples=20)
    for _ in range(19):
        est.add(3.0)
    clock.advance(1)
    assert rule.value(est) == 7.0  # 19 samples: not yet trusted
    est.add(3.0)
    clock.advance(1)
    assert rule.value(est) == pytest.approx(4.5, rel=0.02)  # 1.5 x 3 s
    fast = RollingQuantiles(clock=clock)
    slow = RollingQuantiles(clock=clock)
    for _ in range(50):
        fast.add(0.1)
        slow.add(30.0)
    clock.advance(1)
    assert rule.value(fast) == 2.0  # floor
    assert rule.value(slow) == 10.0  # ceiling


def test_a_deferred_refresh_serves_the_last_view_then_the_new_one_drawn_once() -> None:
    clock = ManualClock()
    later: list[Callable[[], None]] = []
    est = RollingQuantiles(clock=clock, defer=later.append)
    rule = AdaptiveDeadline(k=1.0, floor=0.0, ceiling=100.0, initial=7.0, min_samples=20)
    drawn: list[float] = []

    def draw(e: RollingQuantiles) -> float:
        drawn.append(rule.of(e))
        return drawn[-1]

    for _ in range(50):
        est.add(1.0)
    assert est.derived(rule, draw) == pytest.approx(1.0, rel=0.02)  # nothing held: at once
    for _ in range(500):
        est.add(3.0)
    clock.advance(1)  # the view is stale
    assert est.derived(rule, draw) == pytest.approx(1.0, rel=0.02)  # the last view's value
    assert est.derived(rule, draw) == pytest.approx(1.0, rel=0.02)
    assert len(later) == 1 and len(drawn) == 1  # one refresh on its way, nothing drawn
    later.pop()()
    assert len(drawn) == 2  # drawn by the refresh, not by the next read
    assert est.derived(rule, draw) == pytest.approx(3.0, rel=0.02)
    assert len(drawn) == 2 and not later


def test_without_defer_a_stale_view_is_refreshed_on_the_read() -> None:
    clock = ManualClock()
    est = RollingQuantiles(clock=clock)
    rule = AdaptiveDeadline(k=1.0, floor=0.0, ceiling=100.0, min_samples=20)
    for _ in range(50):
        est.add(1.0)
    assert rule.value(est) == pytest.approx(1.0, rel=0.02)
    for _ in range(500):
        est.add(3.0)
    clock.advance(1)
    assert rule.value(est) == pytest.approx(3.0, rel=0.02)


def test_retry_budget_allows_its_share_of_requests_plus_the_reserve() -> None:
    clock = ManualClock()
    budget = RatioBudget(0.1, reserve=2, window=10, clock=clock)
    for _ in range(100):
        budget.request()
    spent = sum(budget.try_spend() for _ in range(50))
    assert spent == 12  # 10% of 100 + 2
    assert not budget.try_spend()


def test_retry_budget_refills_as_the_window_moves_on() -> None:
    clock = ManualClock()
    budget = RatioBudget(0.1, reserve=0, window=10, clock=clock)
    for _ in range(100):
        budget.request()
    while budget.try_spend():
        pass
    clock.advance(11)  # the old requests and spends left the window
    assert not budget.try_spend()  # no requests yet in the new window: nothing earned
    for _ in range(10):
        budget.request()
    assert budget.try_spend()


def test_during_an_outage_retries_stay_at_the_budget_share() -> None:
    """Every request fails and wants 2 retries: the budget keeps the extra load at 10%."""
    clock = ManualClock()
    budget = RatioBudget(0.1, reserve=1, window=10, clock=clock)
    sent = 0
    for _ in range(1000):
        clock.advance(0.05)  # 20 requests/s
        budget.request()
        sent += 1
        for _ in range(2):
            if budget.try_spend():
                sent += 1
    assert sent <= 1000 * 1.1 + 1 * 5  # ratio + one reserve per window (50 s: 5 windows)


def test_backoff_is_jittered_exponential_and_capped() -> None:
    rng = random.Random(0)
    for attempt, top in ((1, 0.1), (2, 0.2), (3, 0.4), (10, 2.0)):
        samples = [backoff(attempt, 0.1, 2.0, rng) for _ in range(200)]
        assert all(0 <= s <= top for s in samples)
        assert max(samples) > 0.8 * top  # spread over the whole range


def test_circuit_opens_after_failures_in_a_row_and_a_probe_closes_it() -> None:
    clock = ManualClock()
    changes: list[State] = []  # each change of state, once (the state gauge is set then)
    b = CircuitBreaker(failures=3, cooldown=10, clock=clock, changed=changes.append)
    b.failure()
    b.failure()
    b.success()  # not in a row
    b.failure()
    b.failure()
    assert b.state is State.CLOSED and b.allow()
    b.failure()
    assert b.state is State.OPEN and not b.allow()
    clock.advance(9.9)
    assert not b.allow()
    clock.advance(0.1)
    assert b.allow()  # the probe
    assert b.state is State.HALF_OPEN
    assert not b.allow()  # one probe at a time
    b.success()
    assert b.state is State.CLOSED and b.allow()
    b.success()
    assert changes == [State.OPEN, State.HALF_OPEN, State.CLOSED]


def test_a_failed_probe_opens_the_circuit_for_another_cooldown() -> None:
    clock = ManualClock()
    changes: list[State] = []
    b = CircuitBreaker(failures=1, cooldown=5, clock=clock, changed=changes.append)
    b.failure()
    clock.advance(5)
    assert b.allow()
    b.failure()
    assert b.state is State.OPEN and not b.allow()
    clock.advance(5)
    assert b.allow()
    assert changes == [State.OPEN, State.HALF_OPEN, State.OPEN, State.HALF_OPEN]


def test_a_probe_that_never_reports_is_forgotten_after_a_cooldown() -> None:
    clock = ManualClock()
    b = CircuitBreaker(failures=1, cooldown=5, clock=clock)
    b.failure()
    clock.advance(5)
    assert b.allow()  # probe sent, then cancelled: no success() or failure()
    clock.advance(5)
    assert b.allow()


def test_prompt_size_classes_separate_long_prompts() -> None:
    assert [prompt_class(n) for n in (10, 1023, 1024, 4095, 4096, 16384, 10**6)] == [
        0,
        0,
        1,
        1,
        2,
        3,
        3,
    ]


def test_only_single_choice_answers_without_tools_can_continue() -> None:
    assert COMPLETIONS.continuable({"prompt": "hi"})
    assert CHAT.continuable({"messages": []})
    assert not CHAT.continuable({"messages": [], "tools": [{}]})
    assert not COMPLETIONS.continuable({"prompt": ["a", "b"]})
    assert not COMPLETIONS.continuable({"prompt": "hi", "n": 2})
    assert not COMPLETIONS.continuable({"prompt": "hi", "echo": True})


def test_hedge_delay_counts_cut_stalls_as_slower_than_every_ttft_seen() -> None:
    from tokenpipe.router import Router
    from tokenpipe.router.policy import Policy
    from tokenpipe.settings import TailSettings

    clock = ManualClock()
    tail = Policy(TailSettings(), Router([]), clock)
    assert tail.hedge_delay("u", "m", 0) == 1.0  # no samples: the static delay
    for i in range(100):
        tail.ttft_estimate("u", "m", 0).add(0.010 + i * 0.001)  # 10-109 ms, evenly
    clock.advance(1)
    plain = tail.hedge_delay("u", "m", 0)
    assert plain == pytest.approx(0.105, rel=0.02)  # the p95 of what completed
    for _ in range(5):
        tail.censored("u", "m", 0)  # 5 stalls cut short: 5% of 105
    clock.advance(1)
    # With the stalls counted, the p95 of all requests is the top of the ordinary ones.
    assert tail.hedge_delay("u", "m", 0) == pytest.approx(0.109, rel=0.02)


def test_the_deadline_gauge_shows_each_new_hedge_delay() -> None:
    from tokenpipe.observe import metrics
    from tokenpipe.router import Router
    from tokenpipe.router.policy import Policy
    from tokenpipe.settings import TailSettings

    metrics.allow_model("gauged-model")  # (a model label of its own, whatever ran before)

    def shown() -> float | None:
        labels = {"kind": "hedge_delay", "upstream": "gauged", "model": "gauged-model"}
        return metrics.REGISTRY.get_sample_value("tokenpipe_deadline_seconds", labels)

    clock = ManualClock()
    tail = Policy(TailSettings(), Router([]), clock)
    assert tail.hedge_delay("gauged", "gauged-model", 0) == shown() == 1.0  # the static delay
    for i in range(100):
        tail.ttft_estimate("gauged", "gauged-model", 0).add(0.010 + i * 0.001)
    assert shown() == 1.0  # (set when asked for, not when observed)
    clock.advance(1)
    learned = tail.hedge_delay("gauged", "gauged-model", 0)
    assert learned == pytest.approx(0.105, rel=0.02) and shown() == learned
    # Unchanged: not set again, still shown.
    assert tail.hedge_delay("gauged", "gauged-model", 0) == shown() == learned


def test_the_deadline_gauges_are_set_as_a_refresh_draws_them() -> None:
    """The TTFT and stall deadlines' gauges show each value when a view's refresh draws it:
    with the refresh deferred (the gateway's), once it ran, before any read asks again."""
    from tokenpipe.observe import metrics
    from tokenpipe.router import Router
    from tokenpipe.router.policy import Policy
    from tokenpipe.settings import TailSettings

    metrics.allow_model("drawn-model")

    def shown(kind: str) -> float | None:
        labels = {"kind": kind, "upstream": "drawn", "model": "drawn-model"}
        return metrics.REGISTRY.get_sample_value("tokenpipe_deadline_seconds", labels)

    clock = ManualClock()
    later: list[Callable[[], None]] = []
    tail = Policy(TailSettings(), Router([]), clock, defer=later.append)
    ttft, stall = (
        tail.ttft_deadline("drawn", "drawn-model", 0),
        tail.stall_deadline("drawn", "drawn-model"),
    )
    assert (shown("ttft"), shown("stall")) == (ttft, stall)  # the initial values
    for _ in range(100):
        tail.ttft_estimate("drawn", "drawn-model", 0).add(2.0)
        tail.gap_estimate("drawn", "drawn-model").add(3.0)
    clock.advance(1)
    assert tail.ttft_deadline("drawn", "drawn-model", 0) == ttft  # stale: the last value
    assert tail.stall_deadline("drawn", "drawn-model") == stall
    assert (shown("ttft"), shown("stall")) == (ttft, stall)
    while later:
        later.pop()()  # the deferred refreshes draw the new values
    assert shown("ttft") == pytest.approx(3.0, rel=0.02)  # 1.5 x p99 of 2 s
    assert shown("stall") == pytest.approx(tail.stall_deadline("drawn", "drawn-model"))
    assert shown("stall") != stall


def test_a_deadline_read_again_follows_each_refresh_of_its_estimate() -> None:
    """The policy keeps a deadline while its estimate's merged view is the same (it is read
    three times a request); a refreshed view, with new values in it, gives a new deadline."""
    from tokenpipe.router import Router
    from tokenpipe.router.policy import Policy
    from tokenpipe.settings import TailSettings

    clock = ManualClock()
    tail = Policy(TailSettings(), Router([]), clock)
    initial = tail.ttft_deadline("u", "m", 0)
    stall_initial = tail.stall_deadline("u", "m")
    for _ in range(100):
        tail.ttft_estimate("u", "m", 0).add(2.0)
        tail.gap_estimate("u", "m").add(3.0)
    clock.advance(1)  # past the estimates' refresh (0.25 s)
    learned = tail.ttft_deadline("u", "m", 0)
    assert learned != initial and learned == pytest.approx(3.0, rel=0.02)  # 1.5 x p99
    assert tail.stall_deadline("u", "m") != stall_initial
    for _ in range(1000):
        tail.ttft_estimate("u", "m", 0).add(4.0)
    assert tail.ttft_deadline("u", "m", 0) == learned  # the same view: the same deadline
    clock.advance(1)
    assert tail.ttft_deadline("u", "m", 0) == pytest.approx(6.0, rel=0.02)  # the new view
