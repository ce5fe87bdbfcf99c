"""The gateway in front of a rate-limited `tokenpipe sim` (real buckets, OpenAI headers).

Offered load is 3x the limit, open loop (requests start on schedule whatever happens to the
earlier ones). The runs here last ~8 s to keep CI short; `benchmarks/ratelimit.py` runs the
30-second version side by side with a naive client and LiteLLM.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from tests import procs
from tests.redis_server import RedisServer

RPM, DEPTH = 600.0, 2.0  # 10 requests/s, a 20-request-deep bucket
RATE = RPM / 60
SECONDS = 6.0
BODY = {
    "model": "sim-model",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 20,
}


async def offer(urls: list[str], rate: float, seconds: float) -> Counter[Any]:
    """Open-loop load spread round-robin over `urls`; returns client-side outcomes."""
    outcomes: Counter[Any] = Counter()
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(url: str) -> None:
            try:
                async with session.post(url + "/v1/chat/completions", json=BODY) as r:
                    await r.read()
                    outcomes[r.status] += 1
                    if r.status == 429:
                        assert "Retry-After" in r.headers, dict(r.headers)
                        assert any(k.lower().startswith("x-ratelimit-limit-") for k in r.headers)
            except aiohttp.ClientError as e:
                outcomes[type(e).__name__] += 1

        tasks = []
        start = time.monotonic()
        n = int(rate * seconds)
        for i in range(n):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the load schedule, not synchronisation
            tasks.append(asyncio.create_task(one(urls[i % len(urls)])))
        await asyncio.gather(*tasks)
    return outcomes


async def upstream_view(sim_url: str) -> dict[str, float]:
    """What the sim saw: requests it admitted and refused, and the allowance over the span."""
    async with aiohttp.ClientSession() as s, s.get(sim_url + "/sim/stats?last=100000") as r:
        stats = await r.json()
    recs = stats["records"]
    ok = [r["started"] for r in recs if r["status"] == 200]
    refused = sum(1 for r in recs if r["status"] == 429)
    span = max(ok) - min(ok)
    allowed = RATE * span + DEPTH * RATE + 1  # refill over the span plus the full bucket
    return {"ok": len(ok), "429": refused, "sent": len(recs), "allowed": allowed}


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tokenpipe.yaml"
    path.write_text(text)
    return str(path)


@pytest.fixture
def limited_sim() -> Iterator[procs.Service]:
    with procs.sim(
        "--rpm", str(RPM), "--bucket-seconds", str(DEPTH), "--ttft-ms", "20", "--itl-ms", "1"
    ) as s:
        yield s


async def test_three_times_the_limit_becomes_full_goodput_with_almost_no_upstream_429s(
    limited_sim: procs.Service, tmp_path: Path
) -> None:
    # Nothing configured about the limit: it is learned from the sim's headers. A short
    # queue deadline so the run ends soon after the offered load does.
    cfg = _config(tmp_path, "limits:\n  queue_deadline_seconds: 3\n")
    with procs.gateway("--upstream", limited_sim.url + "/v1", "--config", cfg) as gw:
        outcomes = await offer([gw.url], 3 * RATE, SECONDS)
    view = await upstream_view(limited_sim.url)
    print(view, outcomes)
    assert view["ok"] >= 0.95 * view["allowed"], (view, outcomes)
    assert view["429"] <= 0.01 * view["sent"], (view, outcomes)
    # Whatever did not fit was told to come back later, not failed.
    assert set(outcomes) <= {200, 429}, outcomes


async def test_a_token_limit_is_learned_and_kept_too(tmp_path: Path) -> None:
    # 30000 tokens/min = 500/s, 1000 deep; each request costs 8 prompt + 40 max_tokens = 48.
    cost, tps = 48, 500.0
    with procs.sim(
        "--tpm", "30000", "--bucket-seconds", "2", "--ttft-ms", "20", "--itl-ms", "1"
    ) as sim:
        cfg = _config(tmp_path, "limits:\n  queue_deadline_seconds: 3\n")
        with procs.gateway("--upstream", sim.url + "/v1", "--config", cfg) as gw:
            BODY["max_tokens"] = 40
            try:
                outcomes = await offer([gw.url], 3 * tps / cost, SECONDS)
            finally:
                BODY["max_tokens"] = 20
        async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/stats?last=100000") as r:
            recs = (await r.json())["records"]
    ok = [r["started"] for r in recs if r["status"] == 200]
    refused = sum(1 for r in recs if r["status"] == 429)
    allowed = (tps * (max(ok) - min(ok)) + 2 * tps) / cost + 1
    print(len(ok), allowed, refused, outcomes)
    assert len(ok) >= 0.95 * allowed, (len(ok), allowed, outcomes)
    assert refused <= 0.01 * len(recs), (refused, len(recs))


async def test_three_gateways_sharing_redis_stay_within_102_percent_of_the_limit(
    limited_sim: procs.Service, tmp_path: Path
) -> None:
    with RedisServer() as redis:
        cfg = _config(
            tmp_path,
            f"limits:\n  backend: redis\n  redis: {{url: '{redis.url}'}}\n"
            "  queue_deadline_seconds: 3\n",
        )
        args = ("--upstream", limited_sim.url + "/v1", "--config", cfg)
        with procs.gateway(*args) as a, procs.gateway(*args) as b, procs.gateway(*args) as c:
            outcomes = await offer([a.url, b.url, c.url], 3 * RATE, SECONDS)
    view = await upstream_view(limited_sim.url)
    print(view, outcomes)
    assert view["sent"] <= 1.02 * view["allowed"], (view, outcomes)
    assert view["ok"] >= 0.95 * view["allowed"], (view, outcomes)
    assert view["429"] <= 0.01 * view["sent"], (view, outcomes)


async def _fallback_gauge(url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("tokenpipe_limits_redis_fallback "):
                return float(line.split()[1])
    return -1.0


async def test_killing_redis_mid_run_fails_no_request(
    limited_sim: procs.Service, tmp_path: Path
) -> None:
    with RedisServer() as redis:
        cfg = _config(tmp_path, f"limits:\n  backend: redis\n  redis: {{url: '{redis.url}'}}\n")
        args = ("--upstream", limited_sim.url + "/v1", "--config", cfg)
        with procs.gateway(*args) as a, procs.gateway(*args) as b:
            # 80% of the limit: every request fits, before and after Redis goes away.
            load = asyncio.create_task(offer([a.url, b.url], 0.8 * RATE, SECONDS))
            await asyncio.sleep(SECONDS / 2)  # let half the run go by with Redis up
            redis.kill()
            outcomes = await load
            assert await _fallback_gauge(a.url) == 1.0
            assert await _fallback_gauge(b.url) == 1.0
            assert "redis unreachable" in a.output() + b.output()
    assert set(outcomes) == {200}, outcomes
    view = await upstream_view(limited_sim.url)
    print(view, outcomes)
    assert view["429"] <= 0.01 * view["sent"], view


async def test_an_upstream_429_pauses_that_upstream_for_its_retry_after(
    sim: procs.Service,
) -> None:
    with procs.gateway("--upstream", sim.url + "/v1") as gw:
        async with aiohttp.ClientSession() as s:
            url = gw.url + "/v1/chat/completions"
            storm = {
                **BODY,
                "stream": False,
                "messages": [{"role": "user", "content": "[[sim fault=status:429]] hi"}],
            }
            async with s.post(url, json=storm) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "1"
            t = time.monotonic()
            async with s.post(url, json={**BODY, "stream": False}) as r:
                assert r.status == 200
            # The sim asked for 1 s; the next request was held that long, not sent into a 429.
            assert time.monotonic() - t >= 0.9
            async with s.get(gw.url + "/metrics") as r:
                text = await r.text()
    samples = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(samples['tokenpipe_upstream_429_total{upstream="upstream0"}']) == 1
    assert float(samples['tokenpipe_concurrency_limit{upstream="upstream0"}']) < 32


async def test_a_gateway_sharing_redis_asks_it_once_a_lease_not_once_a_request(
    sim: procs.Service, tmp_path: Path
) -> None:
    """Far from any limit, a gateway with its buckets in Redis grants most requests from a
    lease: 80 requests, 8 at a time, run fewer than 40 scripts in Redis (2 here; without
    leases 80, a reservation each)."""
    with RedisServer() as server:
        cfg = _config(tmp_path, f"limits:\n  backend: redis\n  redis: {{url: '{server.url}'}}\n")
        with procs.gateway("--upstream", sim.url + "/v1", "--config", cfg) as g:
            stats = redis.Redis(port=server.port)
            async with aiohttp.ClientSession() as session:

                async def one() -> int:
                    url = g.url + "/v1/chat/completions"
                    async with session.post(url, json={**BODY, "max_tokens": 1}) as r:
                        await r.read()
                        return r.status

                await one()  # (Redis learns the scripts)
                before = stats.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
                statuses: list[int] = []
                for _ in range(10):
                    statuses += await asyncio.gather(*(one() for _ in range(8)))
                after = stats.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert statuses == [200] * 80
    assert after - before < 40, after - before
