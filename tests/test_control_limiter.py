"""The upstream Limiter gate on a ManualClock: fairness across keys, learning from headers,
pauses after 429, the queue deadline and its 429, bounds."""

from __future__ import annotations

import asyncio
import math

import pytest

from tokenpipe.clock import ManualClock
from tokenpipe.control.aimd import AIMDLimit
from tokenpipe.control.levels import LEARN_ALL_BELOW, LEARN_EVERY_S
from tokenpipe.control.limiter import REQUEST_MARGIN, Limiter
from tokenpipe.control.store import Limits, MemoryStore, Spec
from tokenpipe.errors import GatewayError

ONE_PER_SECOND = Limits(requests=Spec(rate=1.0, capacity=1.0))


def virtual(clock: ManualClock):  # type: ignore[no-untyped-def]
    """A sleep that moves the manual clock instead of waiting."""

    async def sleep(seconds: float) -> None:
        clock.advance(seconds)
        await asyncio.sleep(0)

    return sleep


async def test_keys_take_turns_so_a_flood_from_one_key_does_not_starve_another() -> None:
    clock = ManualClock()
    lim = Limiter(
        "u", MemoryStore(clock), configured=ONE_PER_SECOND, clock=clock, sleep=virtual(clock)
    )
    order: list[str] = []

    async def one(key: str) -> None:
        permit = await lim.acquire(key, 1, deadline=60)
        order.append(key)
        lim.release(permit, 200)

    flood = [asyncio.create_task(one("a")) for _ in range(8)]
    await asyncio.sleep(0)
    few = [asyncio.create_task(one("b")) for _ in range(2)]
    await asyncio.gather(*flood, *few)
    # "a" got the full bucket at once; after that the keys alternate while both wait.
    assert order[:5] == ["a", "a", "b", "a", "b"]
    assert math.isclose(clock.now(), 9.0)  # 10 requests at 1/s from a 1-deep bucket


async def test_headers_teach_an_unconfigured_limiter_the_upstream_bucket() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    lim = Limiter("u", store, clock=clock, wall=lambda: 0.0)
    permit = await lim.acquire("k", 1, deadline=1)
    await lim.observe(
        permit,
        200,
        {
            "x-ratelimit-limit-requests": "600",
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "2s",
        },
    )
    assert lim.limits.requests == Spec(rate=10.0, capacity=20.0)
    d = await store.reserve(lim.scope, lim.limits, 1)
    # Empty bucket, 10 per second, and the half-request safety margin under learned levels.
    assert math.isclose(d.wait, (1 + REQUEST_MARGIN) / 10)


async def test_answers_that_say_the_same_limits_keep_the_learned_limits_and_the_buckets() -> None:
    """Equal limits keep the one Limits object, so the store does not fit the scope's
    buckets again on every answer read; new limits replace it, and the levels reported are
    still learned (answers LEARN_EVERY_S apart: each is read)."""
    clock = ManualClock()
    store = MemoryStore(clock)
    lim = Limiter("u", store, clock=clock, wall=lambda: 0.0)

    def said(limit: str, remaining: str) -> dict[str, str]:
        return {
            "x-ratelimit-limit-requests": limit,
            "x-ratelimit-remaining-requests": remaining,
            "x-ratelimit-reset-requests": "0s",
        }

    await lim.observe(await lim.acquire("k", 1, deadline=1), 200, said("600", "600"))
    first = lim.limits
    await store.reserve(lim.scope, first, 1)
    fitted = store._scopes[lim.scope]
    assert fitted.fitted is first
    clock.advance(LEARN_EVERY_S)
    await lim.observe(await lim.acquire("k", 1, deadline=1), 200, said("600", "5"))
    assert lim.limits is first and fitted.fitted is first
    assert fitted.requests is not None and fitted.requests.level < 6  # the level was learned
    await lim.observe(await lim.acquire("k", 1, deadline=1), 200, said("1200", "1200"))
    assert lim.limits is not first and lim.limits.requests == Spec(rate=20.0, capacity=1200.0)


async def test_a_busy_gateway_reads_the_headers_every_window_and_every_answer_once_low() -> None:
    """While the level last stated is above LEARN_ALL_BELOW of its bucket, an answer within
    LEARN_EVERY_S of the last one read is not read (the local bucket holds the level); once a
    stated level is below it, every answer is; a 429 always is."""
    clock = ManualClock()
    store = MemoryStore(clock)
    lim = Limiter("u", store, clock=clock, wall=lambda: 0.0)

    def said(remaining: int) -> dict[str, str]:
        return {
            "x-ratelimit-limit-requests": "6000",  # 100 a second, a bucket 6,000 deep
            "x-ratelimit-remaining-requests": str(remaining),
            "x-ratelimit-reset-requests": "10ms",
        }

    async def answer(remaining: int) -> float:
        await lim.observe(await lim.acquire("k", 1, deadline=1), 200, said(remaining))
        bucket = store._scopes[lim.scope].requests
        assert bucket is not None
        return bucket.level

    low = int(LEARN_ALL_BELOW * 6000)
    assert await answer(5999) > 5990  # read: the first answer
    assert await answer(3000) > 5990  # not read: within the window, the level high
    clock.advance(LEARN_EVERY_S * 0.99)
    assert await answer(3000) > 5990  # not yet
    clock.advance(LEARN_EVERY_S * 0.01)
    assert abs(await answer(low - 100) - (low - 100)) < 2  # the window over: read
    assert abs(await answer(low - 200) - (low - 200)) < 2  # low: every answer is read
    assert abs(await answer(low - 300) - (low - 300)) < 2
    clock.advance(LEARN_EVERY_S)
    assert await answer(5999) > 5990  # high again: read, and the window starts again
    assert await answer(10) > 5980
    # A 429 within the window is read: its pause holds.
    permit = await lim.acquire("k", 1, deadline=1)
    await lim.observe(permit, 429, {**said(0), "retry-after-ms": "1500"})
    lim.release(permit, 429)
    assert math.isclose((await store.reserve(lim.scope, lim.limits, 1)).wait, 1.5)
    await lim.close()


async def test_an_upstream_429_pauses_the_upstream_and_shrinks_concurrency() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    aimd = AIMDLimit(10, clock=clock)
    lim = Limiter("u", store, concurrency=aimd, clock=clock, wall=lambda: 0.0)
    permit = await lim.acquire("k", 1, deadline=1)
    await lim.observe(permit, 429, {"retry-after-ms": "1500"})
    lim.release(permit, 429)
    assert aimd.limit == 9
    assert math.isclose((await store.reserve(lim.scope, lim.limits, 1)).wait, 1.5)
    clock.advance(1.5)
    assert (await store.reserve(lim.scope, lim.limits, 1)).wait == 0.0


async def test_past_the_queue_deadline_the_client_gets_429_with_retry_after_and_limits() -> None:
    clock = ManualClock()  # frozen: the bucket never refills
    lim = Limiter(
        "u",
        MemoryStore(clock),
        configured=Limits(
            requests=Spec(rate=10, capacity=1), tokens=Spec(rate=1000, capacity=1000)
        ),
        clock=clock,
    )
    await lim.acquire("k", 1, deadline=1)
    with pytest.raises(GatewayError) as e:
        await lim.acquire("k", 1, deadline=0.02)
    err = e.value
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert int(err.headers["Retry-After"]) >= 1
    assert err.headers["x-ratelimit-limit-requests"] == "600"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert err.headers["x-ratelimit-limit-tokens"] == "60000"
    await lim.close()


async def test_the_waiting_queue_is_bounded() -> None:
    clock = ManualClock()
    lim = Limiter("u", MemoryStore(clock), configured=ONE_PER_SECOND, clock=clock, max_waiting=1)
    await lim.acquire("k", 1, deadline=1)
    waiting = asyncio.create_task(lim.acquire("k", 1, deadline=30))
    await asyncio.sleep(0)
    assert lim.waiting == 1
    with pytest.raises(GatewayError) as e:
        await lim.acquire("other", 1, deadline=30)
    assert e.value.status == 429
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await lim.close()


async def test_concurrency_limit_holds_requests_until_a_permit_is_released() -> None:
    clock = ManualClock()
    lim = Limiter("u", MemoryStore(clock), concurrency=AIMDLimit(2, clock=clock), clock=clock)
    p1 = await lim.acquire("k", 1, deadline=1)
    await lim.acquire("k", 1, deadline=1)
    third = asyncio.create_task(lim.acquire("k", 1, deadline=30))
    await asyncio.sleep(0.01)
    assert not third.done() and lim.inflight == 2
    lim.release(p1, 200)
    p3 = await asyncio.wait_for(third, 5)
    assert lim.inflight == 2 and p3.key == "k"
    await lim.close()


async def test_a_permit_that_was_never_sent_returns_its_reservation() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    lim = Limiter("u", store, configured=ONE_PER_SECOND, clock=clock)
    permit = await lim.acquire("k", 1, deadline=1)
    lim.release(permit, None, sent=False)
    assert lim.inflight == 0
    assert (await store.reserve(lim.scope, lim.limits, 1)).wait == 0.0


async def test_token_reservations_are_corrected_by_what_the_upstream_charged() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    tokens = Limits(tokens=Spec(rate=1, capacity=1000))
    lim = Limiter("u", store, configured=tokens, clock=clock)
    permit = await lim.acquire("k", 600, deadline=1)
    lim.release(permit, 200, charged_tokens=150)
    d = await store.reserve(lim.scope, lim.limits, 0)
    assert d.remaining_tokens is not None and math.isclose(d.remaining_tokens, 850)


async def test_a_200_answer_grows_the_limit_before_the_stream_ends() -> None:
    """A burst above the limit is let through as the upstream accepts its first requests,
    not held until their streams end; the end of the stream does not count a second time."""
    clock = ManualClock()
    aimd = AIMDLimit(2, clock=clock)
    lim = Limiter("u", MemoryStore(clock), concurrency=aimd, clock=clock, wall=lambda: 0.0)
    first = [await lim.acquire("k", 1, deadline=1) for _ in range(2)]
    waiting = [asyncio.create_task(lim.acquire("k", 1, deadline=30)) for _ in range(2)]
    await asyncio.sleep(0)
    assert not any(t.done() for t in waiting)
    for permit in first:
        await lim.observe(permit, 200, {})
    assert aimd.limit == 4
    later = await asyncio.wait_for(asyncio.gather(*waiting), 5)
    assert lim.inflight == 4
    for permit in first:
        lim.release(permit, 200)
    assert aimd.limit == 4  # observed already: their end does not count again
    for permit in later:
        lim.release(permit, 200)
    assert aimd.limit == 6  # never observed (e.g. no headers came): counted at their end
    await lim.close()


async def test_a_waiter_that_leaves_while_or_as_it_is_granted_leaks_no_permit() -> None:
    """The client leaves (its task is cancelled) before its permit comes, or in the loop turn
    the dispatcher grants it: either way the slot goes to the next waiter, not lost."""
    clock = ManualClock()
    lim = Limiter(
        "u", MemoryStore(clock), concurrency=AIMDLimit(1, maximum=1, clock=clock), clock=clock
    )
    loop = asyncio.get_running_loop()
    held = await lim.acquire("k", 1, deadline=1)
    for cancel_in_grant_step in (False, True):
        leaving = asyncio.create_task(lim.acquire("k", 1, deadline=30))
        staying = asyncio.create_task(lim.acquire("k", 1, deadline=30))
        while lim.waiting < 2:
            await asyncio.sleep(0)
        if cancel_in_grant_step:
            lim.release(held, 200)  # wakes the dispatcher, which grants `leaving` ...
            loop.call_soon(leaving.cancel)  # ... in the turn this cancel runs in
        else:
            leaving.cancel()
            await asyncio.sleep(0)
            lim.release(held, 200)
        with pytest.raises(asyncio.CancelledError):
            await leaving
        held = await asyncio.wait_for(staying, 5)
        assert lim.inflight == 1 and lim.waiting == 0
    await lim.close()


async def test_a_503_while_others_stream_is_full_the_refused_waits_for_a_slot_first() -> None:
    """The upstream accepted two and refuses the third: it is full at two. The refused request
    waits for a slot again ahead of a newer one, and its release takes nothing more off."""
    clock = ManualClock()
    aimd = AIMDLimit(8, clock=clock)
    lim = Limiter("u", MemoryStore(clock), concurrency=aimd, clock=clock, wall=lambda: 0.0)
    streams = [await lim.acquire("k", 1, deadline=1) for _ in range(2)]
    refused = await lim.acquire("k", 1, deadline=1)
    for permit in streams:
        await lim.observe(permit, 200, {})
    assert lim.accepted == 2
    assert await lim.observe(refused, 503, {})
    lim.release(refused, 503)
    assert aimd.limit == 2  # what it holds, not a further 0.9 of it
    newer = asyncio.create_task(lim.acquire("k", 1, deadline=30))
    while not lim.waiting:
        await asyncio.sleep(0)
    again = asyncio.create_task(lim.acquire("k", 1, deadline=30, front=True))
    while lim.waiting < 2:
        await asyncio.sleep(0)
    lim.release(streams[0], 200)  # one stream ends: one slot
    retried = await asyncio.wait_for(again, 5)
    assert not newer.done() and lim.accepted == 1
    lim.release(retried, 200)
    await asyncio.wait_for(newer, 5)
    await lim.close()


async def test_a_503_from_an_upstream_holding_nothing_is_a_failure_not_full() -> None:
    clock = ManualClock()
    aimd = AIMDLimit(8, clock=clock)
    lim = Limiter("u", MemoryStore(clock), concurrency=aimd, clock=clock, wall=lambda: 0.0)
    permit = await lim.acquire("k", 1, deadline=1)
    assert not await lim.observe(permit, 503, {})
    lim.release(permit, 503)
    assert aimd.limit == 8 * 0.9 and not aimd.capped  # the ordinary drop
    await lim.close()


async def test_a_cold_limit_opens_at_the_first_answer_of_an_upstream_needing_no_probe() -> None:
    """A private upstream (a self-hosted engine), or one whose quotas are known (its headers
    or the config), lets the rest of a cold burst out at its first 200; a public one with no
    quota known is probed, slow start doubling per round of answers (control/limiter.py)."""
    quota = {"x-ratelimit-limit-requests": "6000", "x-ratelimit-remaining-requests": "5999"}
    configured = Limits(requests=Spec(rate=100.0, capacity=100.0))
    cases = (
        (True, {}, None, True),
        (True, quota, None, True),
        (False, quota, None, True),
        (False, {}, configured, True),
        (False, {}, None, False),
    )
    for private, headers, limits, opens in cases:
        clock = ManualClock()
        aimd = AIMDLimit(2, maximum=64, clock=clock, slow_start=True)
        lim = Limiter(
            "u",
            MemoryStore(clock),
            configured=limits,
            concurrency=aimd,
            clock=clock,
            wall=lambda: 0.0,
        )
        first = [await lim.acquire("k", 1, deadline=1) for _ in range(2)]
        waiting = [asyncio.create_task(lim.acquire("k", 1, deadline=30)) for _ in range(10)]
        while lim.waiting < 10:
            await asyncio.sleep(0)
        await lim.observe(first[1], 200, headers, private=private)
        assert aimd.limit == (64 if opens else 4), (private, headers, limits)
        if opens:  # the whole burst is out at once
            await asyncio.wait_for(asyncio.gather(*waiting), 5)
            assert lim.inflight == 12 and lim.waiting == 0
        else:
            for t in waiting:
                t.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        await lim.close()


async def test_answers_to_a_flood_arriving_out_of_order_never_learn_more_than_is_left() -> None:
    """Ten requests sent together: the upstream answers the first (no headers), then the
    last, which reached it second: its answer says 98 of 100 are left, but the eight others
    are on their way and will be counted. Its answer counts from the oldest request still
    unanswered (`levels.counted_from`), so the level learned is at most the 90 really left
    (counted from its own reservation it was 98, and the buckets let through eight requests
    the upstream then refused with 429)."""
    headers = {
        "x-ratelimit-limit-requests": "6000",  # 100 a second
        "x-ratelimit-remaining-requests": "98",
        "x-ratelimit-reset-requests": "20ms",
    }
    for sent_ago, most in ((0.0, 90.0), (2.0, 98.0)):
        clock = ManualClock()
        store = MemoryStore(clock)
        lim = Limiter("u", store, clock=clock, wall=lambda: 0.0)
        flood = [await lim.acquire("k", 1, deadline=1) for _ in range(10)]
        await lim.observe(flood[0], 200, {})  # answered (no headers): counted, not pending
        assert flood[0] not in lim._unanswered
        clock.advance(sent_ago)  # past UNCOUNTED_S: the others have reached the upstream
        await lim.observe(flood[-1], 200, headers)
        d = await store.reserve(lim.scope, lim.limits, 0)  # takes one more
        assert d.remaining_requests is not None
        assert most - 3 < d.remaining_requests + 1 <= most, (sent_ago, d.remaining_requests)
        for permit in flood:
            lim.release(permit, 200)
        assert not lim._unanswered  # each left at its answer or release
        await lim.close()


async def test_a_drop_before_the_first_answer_leaves_the_limit_probing() -> None:
    clock = ManualClock()
    aimd = AIMDLimit(2, maximum=64, clock=clock, slow_start=True)
    lim = Limiter("u", MemoryStore(clock), concurrency=aimd, clock=clock, wall=lambda: 0.0)
    refused = await lim.acquire("k", 1, deadline=1)
    lim.release(refused, 429)  # a sign of overload came first: probing from here on
    assert not aimd.slow_start
    permit = await lim.acquire("k", 1, deadline=1)
    await lim.observe(permit, 200, {}, private=True)
    assert math.isclose(aimd.limit, 2 * 0.9 + 1)  # additive, not opened
    await lim.close()
