"""Per-key quotas (Admission) on a ManualClock: RPM, TPM, concurrency, the 429 they send."""

from __future__ import annotations

import math

import pytest

from tokenpipe.clock import ManualClock
from tokenpipe.control.admission import Admission
from tokenpipe.control.store import MemoryStore
from tokenpipe.errors import GatewayError
from tokenpipe.settings import KeyQuota


async def test_a_key_over_its_rpm_gets_429_saying_when_to_come_back() -> None:
    clock = ManualClock()
    adm = Admission({"alice": KeyQuota(rpm=60, bucket_seconds=2)}, MemoryStore(clock))
    await adm.admit("alice", 10)
    await adm.admit("alice", 10)
    with pytest.raises(GatewayError) as e:
        await adm.admit("alice", 10)
    err = e.value
    assert err.status == 429 and err.type == "rate_limit_error"
    assert err.headers["Retry-After"] == "1"
    assert err.headers["x-ratelimit-limit-requests"] == "60"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert "requests" in err.message
    clock.advance(1.0)
    await adm.admit("alice", 10)


async def test_keys_are_budgeted_separately_and_star_is_the_default_per_key() -> None:
    clock = ManualClock()
    quotas = {"*": KeyQuota(rpm=60, bucket_seconds=1), "big": KeyQuota(rpm=6000)}
    adm = Admission(quotas, MemoryStore(clock))
    await adm.admit("a", 1)
    await adm.admit("b", 1)  # its own bucket, not a's
    with pytest.raises(GatewayError):
        await adm.admit("a", 1)
    for _ in range(50):
        await adm.admit("big", 1)


async def test_tpm_reservations_are_corrected_from_what_was_charged() -> None:
    clock = ManualClock()
    adm = Admission({"k": KeyQuota(tpm=600, bucket_seconds=1)}, MemoryStore(clock))  # 10/s, 10 deep
    grant = await adm.admit("k", 10)
    assert grant is not None
    with pytest.raises(GatewayError) as e:
        await adm.admit("k", 10)
    assert "tokens" in e.value.message and e.value.headers["x-ratelimit-limit-tokens"] == "600"
    grant.finish(charged_tokens=4)  # the request cost 4: 6 come back
    await adm.admit("k", 6)


async def test_concurrency_quota_counts_requests_in_flight_and_frees_them_at_the_end() -> None:
    adm = Admission({"k": KeyQuota(max_concurrency=2)}, MemoryStore(ManualClock()))
    g1 = await adm.admit("k", 1)
    await adm.admit("k", 1)
    with pytest.raises(GatewayError) as e:
        await adm.admit("k", 1)
    assert e.value.status == 429 and "concurrent" in e.value.message
    assert g1 is not None
    g1.finish(None)
    g1.finish(None)  # a second finish changes nothing
    await adm.admit("k", 1)
    with pytest.raises(GatewayError):
        await adm.admit("k", 1)


async def test_a_worker_enforces_its_share_of_a_concurrency_quota() -> None:
    adm = Admission({"k": KeyQuota(max_concurrency=4)}, MemoryStore(ManualClock()), share=0.5)
    await adm.admit("k", 1)
    await adm.admit("k", 1)
    with pytest.raises(GatewayError):
        await adm.admit("k", 1)


async def test_keys_without_a_quota_pass_untouched() -> None:
    adm = Admission({"other": KeyQuota(rpm=1)}, MemoryStore(ManualClock()))
    assert await adm.admit("free", math.inf) is None
