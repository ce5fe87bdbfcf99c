"""RedisStore against a real redis-server: atomic shared buckets, learning across replicas,
fallback to a local share when Redis dies, and going back when it returns."""

from __future__ import annotations

import asyncio
import math
import os
import signal
from collections.abc import Iterator

import pytest
import redis

from tests.redis_server import RedisServer
from tokenpipe.clock import ManualClock
from tokenpipe.control.redis_backend import RedisStore
from tokenpipe.control.store import Decision, Limits, Spec
from tokenpipe.observe import metrics

# Slow refill, so the few milliseconds a test takes do not add a whole unit.
LIMITS = Limits(requests=Spec(rate=0.01, capacity=20), tokens=Spec(rate=0.01, capacity=10_000))


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as r:
        yield r


async def test_three_replicas_share_one_bucket_and_never_overdraw_it(
    redis_server: RedisServer,
) -> None:
    stores = [RedisStore(redis_server.url, prefix="t1", timeout=2.0) for _ in range(3)]
    try:
        results = await asyncio.gather(
            *(s.reserve("up:a", LIMITS, 100) for s in stores for _ in range(15))
        )
        granted = [d for d in results if d.wait == 0.0]
        assert len(granted) == 20  # exactly the bucket, from 45 concurrent asks
        assert sorted(d.seq_requests for d in granted) == [float(i) for i in range(1, 21)]
        refused = [d for d in results if d.wait > 0]
        assert all(d.wait > 50 for d in refused)  # one request at 0.01/s
    finally:
        for s in stores:
            await s.close()


async def test_headers_learned_by_one_replica_hold_for_all_corrected_by_later_sends(
    redis_server: RedisServer,
) -> None:
    a = RedisStore(redis_server.url, prefix="t2", timeout=2.0)
    b = RedisStore(redis_server.url, prefix="t2", timeout=2.0)
    try:
        first = await a.reserve("up:x", LIMITS, 10)
        await b.reserve("up:x", LIMITS, 10)
        await b.reserve("up:x", LIMITS, 10)
        await a.learn("up:x", LIMITS, 5, 1000, first)  # two sent after `first`
        d = await b.reserve("up:x", LIMITS, 10)
        assert d.remaining_requests is not None and math.isclose(
            d.remaining_requests, 2, abs_tol=0.01
        )
        assert d.remaining_tokens is not None and math.isclose(d.remaining_tokens, 970, abs_tol=0.1)
        await a.pause("up:x", 30)
        assert (await b.reserve("up:x", LIMITS, 1)).wait > 29
    finally:
        await a.close()
        await b.close()


async def test_corrections_reach_redis_without_blocking_the_caller(
    redis_server: RedisServer,
) -> None:
    s = RedisStore(redis_server.url, prefix="t3", timeout=2.0)
    await s.start()
    try:
        await s.reserve("up:x", LIMITS, 5000)
        s.give("up:x", LIMITS, 0, 4000)  # returns at once; flushed in the background
        deadline = asyncio.get_running_loop().time() + 5
        while True:
            d = await s.reserve("up:x", LIMITS, 0)
            if d.remaining_tokens is not None and d.remaining_tokens > 8999:
                break
            assert asyncio.get_running_loop().time() < deadline, d
            await asyncio.sleep(0.01)
    finally:
        await s.close()


async def test_a_learned_level_leaves_the_callers_path_and_reaches_every_replica(
    redis_server: RedisServer,
) -> None:
    """Started, a store queues what an answer's headers say, and its flush task sends it:
    the caller (a request about to read its first token) does not wait on Redis, even on a
    Redis that hangs, and the level reaches the other replicas once Redis answers."""
    a = RedisStore(redis_server.url, prefix="t5", timeout=2.0)
    b = RedisStore(redis_server.url, prefix="t5", timeout=2.0)
    await a.start()
    loop = asyncio.get_running_loop()
    assert redis_server.proc is not None
    try:
        first = await a.reserve("up:x", LIMITS, 10)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # a round trip now waits 2 s
        try:
            await asyncio.wait_for(a.learn("up:x", LIMITS, 5, 1000, first), 0.5)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        deadline = loop.time() + 5
        while True:  # 9,990 tokens left before; 1,000 once learned (reserving 0 takes none)
            d = await b.reserve("up:x", LIMITS, 0)
            if d.remaining_tokens is not None and d.remaining_tokens < 2000:
                break
            assert loop.time() < deadline, d
            await asyncio.sleep(0.01)  # polling a condition with a deadline
        assert a.healthy and math.isclose(d.remaining_tokens, 1000, abs_tol=0.1)
    finally:
        await a.close()
        await b.close()


async def test_when_redis_dies_decisions_fall_back_to_a_local_share_and_return_after(
    redis_server: RedisServer,
) -> None:
    stores = [RedisStore(redis_server.url, prefix="t4", timeout=0.2) for _ in range(2)]
    for s in stores:
        await s.start()
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + 5
        while not all(s.replicas == 2 for s in stores):  # heartbeats counted both
            assert loop.time() < deadline
            await asyncio.sleep(0.05)
        redis_server.kill()
        s = stores[0]
        started = loop.time()
        decisions = [await s.reserve("up:y", LIMITS, 1) for _ in range(20)]
        assert loop.time() - started < 1.0  # no decision waits on the dead Redis for long
        assert not s.healthy
        assert metrics.REGISTRY.get_sample_value("tokenpipe_limits_redis_fallback") == 1
        assert sum(d.wait == 0.0 for d in decisions) == 10  # half of 20: one of two replicas
        redis_server.start()
        deadline = loop.time() + 10
        while not s.healthy:
            assert loop.time() < deadline, "did not go back to Redis"
            await asyncio.sleep(0.05)
        assert metrics.REGISTRY.get_sample_value("tokenpipe_limits_redis_fallback") == 0
        d = await s.reserve("up:z", LIMITS, 1)
        assert d.wait == 0.0 and d.origin != 0  # answered by Redis again
    finally:
        for st in stores:
            await st.close()


# -- leases: a started store grants from units it took, far from the limits -------------------

#: Far from its limits: a lease of 1/2 of what is above a quarter (one replica).
ROOMY = Limits(requests=Spec(rate=0.01, capacity=100), tokens=Spec(rate=0.01, capacity=100_000))


def _evalsha(server: RedisServer) -> int:
    """Scripts Redis has run since it started: a reservation, a correction, a learned level."""
    stats = redis.Redis(port=server.port).info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def _started(server: RedisServer, prefix: str, clock: ManualClock) -> RedisStore:
    s = RedisStore(server.url, prefix=prefix, timeout=2.0, clock=clock)
    await s.start()
    return s


async def _seen_by_another(server: RedisServer, prefix: str, scope: str) -> Decision:
    """What a replica with no lease (unstarted) finds in the scope: its reservation of one
    request and 0 tokens, which takes that one request."""
    other = RedisStore(server.url, prefix=prefix, timeout=2.0)
    try:
        return await other.reserve(scope, ROOMY, 0)
    finally:
        await other.close()


async def test_a_started_store_grants_from_a_lease_without_asking_redis(
    redis_server: RedisServer,
) -> None:
    clock = ManualClock()  # stands still: the lease does not end while the test runs
    s = await _started(redis_server, "l1", clock)
    try:
        await s.reserve("up:warm", ROOMY, 0)  # (Redis learns the script: a second call)
        before = _evalsha(redis_server)
        decisions = [await s.reserve("up:x", ROOMY, 100) for _ in range(20)]
        assert _evalsha(redis_server) - before == 1  # the first asked; 19 from its lease
        assert all(d.wait == 0.0 for d in decisions)
        assert [d.seq_requests for d in decisions] == [float(i) for i in range(1, 21)]
        assert [d.seq_tokens for d in decisions] == [100.0 * i for i in range(1, 21)]
        # The levels a grant reports: the bucket's, with what the lease has left in it.
        assert decisions[-1].remaining_requests == pytest.approx(80, abs=0.01)
        assert decisions[-1].remaining_tokens == pytest.approx(98_000, abs=1)
        clock.advance(0.051)  # the lease is over: the next asks Redis, giving back the rest
        await s.reserve("up:x", ROOMY, 100)
        assert _evalsha(redis_server) - before == 2
    finally:
        await s.close()
    d = await _seen_by_another(redis_server, "l1", "up:x")  # 21 sent, nothing held
    assert d.remaining_requests == pytest.approx(100 - 22, abs=0.01)
    assert d.remaining_tokens == pytest.approx(100_000 - 2_100, abs=1)


async def test_leasing_replicas_never_grant_more_than_the_bucket_holds(
    redis_server: RedisServer,
) -> None:
    """Three replicas, 40 requests in the bucket, 150 asked in turn: no more than 40 are
    granted while they hold leases, and once they are closed (their leases given back) a
    fourth gets exactly the rest: nothing granted twice, nothing lost."""
    clock = ManualClock()
    small = Limits(requests=Spec(rate=0.0001, capacity=40))
    stores = [await _started(redis_server, "l2", clock) for _ in range(3)]
    try:
        granted = 0
        for i in range(150):
            granted += (await stores[i % 3].reserve("up:y", small, 1)).wait == 0.0
            assert granted <= 40
    finally:
        for st in stores:
            await st.close()
    last = RedisStore(redis_server.url, prefix="l2", timeout=2.0)
    try:
        while (await last.reserve("up:y", small, 1)).wait == 0.0:
            granted += 1
        assert granted == 40
    finally:
        await last.close()


async def test_near_a_limit_every_request_asks_redis(redis_server: RedisServer) -> None:
    clock = ManualClock()
    s = await _started(redis_server, "l3", clock)
    small = Limits(requests=Spec(rate=0.0001, capacity=20))
    try:
        for _ in range(16):  # 19 after the first: a lease of 7; then 4 and 1 more
            assert (await s.reserve("up:z", small, 1)).wait == 0.0
        before = _evalsha(redis_server)
        decisions = [await s.reserve("up:z", small, 1) for _ in range(3)]
        assert [d.wait == 0.0 for d in decisions] == [True, True, True]
        assert _evalsha(redis_server) - before == 3  # at or below a quarter: no lease
    finally:
        await s.close()


async def test_a_pause_from_another_replica_holds_a_lease_holder_once_its_lease_ends(
    redis_server: RedisServer,
) -> None:
    clock = ManualClock()
    a = await _started(redis_server, "l4", clock)
    b = RedisStore(redis_server.url, prefix="l4", timeout=2.0)
    try:
        await a.reserve("up:p", ROOMY, 10)
        await b.pause("up:p", 30)
        assert (await a.reserve("up:p", ROOMY, 10)).wait == 0.0  # within its lease
        clock.advance(0.051)
        assert (await a.reserve("up:p", ROOMY, 10)).wait > 29
        await a.reserve("up:r", ROOMY, 10)  # a lease on another scope; then its own 429
        await a.pause("up:r", 30)
        assert (await a.reserve("up:r", ROOMY, 10)).wait > 29
    finally:
        await a.close()
        await b.close()


async def test_corrections_go_into_a_held_lease_and_back_to_redis_with_it(
    redis_server: RedisServer,
) -> None:
    clock = ManualClock()
    s = await _started(redis_server, "l5", clock)
    try:
        await s.reserve("up:c", ROOMY, 5000)
        before = _evalsha(redis_server)
        s.give("up:c", ROOMY, 0, 4000)  # the upstream counted 1,000
        assert (await s.reserve("up:c", ROOMY, 100)).wait == 0.0
        assert _evalsha(redis_server) - before == 0
    finally:
        await s.close()
    d = await _seen_by_another(redis_server, "l5", "up:c")
    # 1,000 and 100 used; the lease's rest and the 4,000 back in the bucket
    assert d.remaining_tokens == pytest.approx(100_000 - 1_100, abs=1)
    assert d.remaining_requests == pytest.approx(100 - 3, abs=0.01)


async def test_closing_a_store_while_redis_hangs_returns_within_its_bound(
    redis_server: RedisServer,
) -> None:
    """A gateway stopping while its flush task waits on a Redis that does not answer: close()
    gives up after its bound instead of waiting on a task that swallowed its cancel."""
    s = RedisStore(redis_server.url, prefix="l6", timeout=0.2)
    await s.start()
    assert redis_server.proc is not None
    loop = asyncio.get_running_loop()
    try:
        await s.reserve("up:h", ROOMY, 10)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        s.give("up:other", ROOMY, 0, 5)  # no lease there: the flush task sends it, and waits
        await asyncio.sleep(0)
        started = loop.time()
        await asyncio.wait_for(s.close(), 5)
        assert loop.time() - started < 2 * 0.2 + 1.5
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)


async def test_a_reservation_whose_caller_left_gives_back_what_it_took_lease_and_all(
    redis_server: RedisServer,
) -> None:
    """The client leaves while its reservation, which asked for a lease, is on its way to
    Redis: the reservation still completes, and its units (the request's and the lease's) go
    back, instead of staying out of the shared buckets until they refill."""
    s = RedisStore(redis_server.url, prefix="l7", timeout=2.0)
    await s.start()
    assert redis_server.proc is not None
    loop = asyncio.get_running_loop()
    try:
        await s.reserve("up:warm", ROOMY, 0)  # (Redis learns the script)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            left = asyncio.ensure_future(s.reserve("up:u", ROOMY, 100))
            await asyncio.sleep(0)  # it asks Redis (which does not answer yet)
            left.cancel()
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        with pytest.raises(asyncio.CancelledError):
            await left
        levels = redis.Redis(port=redis_server.port)
        deadline = loop.time() + 5
        while True:  # the scope's levels, as Redis holds them, come back whole
            rl, tl = (float(x or 0) for x in levels.hmget("l7:up:u", "rl", "tl"))
            if rl == pytest.approx(100, abs=0.01):
                break
            assert loop.time() < deadline, (rl, tl)
            await asyncio.sleep(0.01)  # polling a condition with a deadline
        assert tl == pytest.approx(100_000, abs=1)
    finally:
        await s.close()


async def test_a_client_leaving_mid_decision_is_not_taken_for_redis_failing(
    redis_server: RedisServer,
) -> None:
    """redis-py answers a cancel inside its call with a connection error: taken as Redis
    failing, every client that left mid-decision put the replica on its local share."""
    s = RedisStore(redis_server.url, prefix="l8", timeout=2.0)  # unstarted: no lease asked
    assert redis_server.proc is not None
    try:
        await s.reserve("up:warm", ROOMY, 0)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            left = asyncio.ensure_future(s.reserve("up:v", ROOMY, 100))
            await asyncio.sleep(0)  # it asks Redis (which does not answer yet)
            left.cancel()
            with pytest.raises(asyncio.CancelledError):
                await left
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert s.healthy
        assert metrics.REGISTRY.get_sample_value("tokenpipe_limits_redis_fallback") != 1
    finally:
        await s.close()


async def test_a_burst_waits_for_the_one_lease_on_its_way_instead_of_asking_redis(
    redis_server: RedisServer,
) -> None:
    """30 reservations at once, no lease yet: the first asks Redis for one (37 requests, a
    half of what is above a quarter of 100), the other 29 wait for it and take from it."""
    clock = ManualClock()
    s = await _started(redis_server, "l9", clock)
    try:
        await s.reserve("up:warm", ROOMY, 0)
        before = _evalsha(redis_server)
        decisions = await asyncio.gather(*(s.reserve("up:b", ROOMY, 10) for _ in range(30)))
        assert _evalsha(redis_server) - before == 1
        assert all(d.wait == 0.0 for d in decisions)
        assert sorted(d.seq_requests for d in decisions) == [float(i) for i in range(1, 31)]
    finally:
        await s.close()


async def test_corrections_to_one_scope_in_a_row_go_to_redis_as_one(
    redis_server: RedisServer,
) -> None:
    s = await _started(redis_server, "l10", ManualClock())
    other = RedisStore(redis_server.url, prefix="l10", timeout=2.0)
    levels = redis.Redis(port=redis_server.port)
    loop = asyncio.get_running_loop()
    try:
        await other.reserve("up:g", ROOMY, 50_000)  # half the tokens; s holds no lease there
        before = _evalsha(redis_server)
        for _ in range(10):
            s.give("up:g", ROOMY, 0, 1_000)
        deadline = loop.time() + 5
        while float(levels.hget("l10:up:g", "tl") or 0) < 59_999:
            assert loop.time() < deadline
            await asyncio.sleep(0.01)  # polling a condition with a deadline
        assert _evalsha(redis_server) - before == 1
    finally:
        await s.close()
        await other.close()
