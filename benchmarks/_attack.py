"""A victim and an attacker against one gateway, for the benchmarks of what a hostile peer
costs the others (hostile_bodies.py: a client's bodies; hostile_events.py: an upstream's
events): the victim's latency alone, then while an attacker process sends its requests at a
fixed rate, and the gateway's CPU meanwhile."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
from _common import ROOT, cpu_seconds, src_dir

#: A victim's request slower than this (ms) counts as held up (alone: p99 ~1.2 ms).
SLOW_MS = 10.0


async def one_at_a_time(
    url: str, body: bytes, seconds: float, headers: dict[str, str] | None = None
) -> list[float]:
    """Latencies (ms) of `body` POSTed to `url` one request at a time for `seconds` (a
    victim's view of the gateway: each must answer 200)."""
    out: list[float] = []
    headers = {"content-type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            async with s.post(url, data=body, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status
            out.append(1e3 * (time.perf_counter() - t))
    return out


def add_args(p: argparse.ArgumentParser, rate: float, what: str, name: str) -> None:
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0, help="victim alone, then attacked")
    p.add_argument("--rate", type=float, default=rate, help=f"attacker's {what} a second")
    p.add_argument("--base-src", type=src_dir, help="src/ of another checkout, measured too")
    p.add_argument("--json", default=str(ROOT / "results" / f"{name}.json"))


def _attacker(
    url: str,
    body: bytes,
    headers: dict[str, str],
    outcome: Callable[[int, bytes], str],
    rate: float,
    seconds: float,
    result: Any,
) -> None:
    """The attacker's process: `rate` requests a second for `seconds`, each in its own task
    (at most 64 at once), counted into `result` by `outcome(status, body)` ("cut": the
    connection failed)."""

    async def run() -> Counter[str]:
        outcomes: Counter[str] = Counter()
        gate = asyncio.Semaphore(64)
        async with aiohttp.ClientSession() as s:

            async def one() -> None:
                async with gate:
                    try:
                        async with s.post(url, data=body, headers=headers) as r:
                            outcomes[outcome(r.status, await r.read())] += 1
                    except aiohttp.ClientError:
                        outcomes["cut"] += 1

            tasks = []
            start = time.perf_counter()
            for i in range(int(rate * seconds)):
                await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
                tasks.append(asyncio.create_task(one()))
            await asyncio.gather(*tasks)
        return outcomes

    result.update(asyncio.run(run()))


def measure(
    gw_pid: int | None,
    victim: tuple[str, bytes, dict[str, str]],
    attacker: tuple[str, bytes, dict[str, str]],
    outcome: Callable[[int, bytes], str],
    args: argparse.Namespace,
) -> tuple[dict[str, float], dict[str, int]]:
    """The victim's latencies alone and attacked (each (url, body, headers)), the gateway's
    CPU seconds under attack, and the attacker's requests by outcome."""
    url, body, headers = victim
    asyncio.run(one_at_a_time(url, body, 1.0, headers))  # warm-up
    alone = asyncio.run(one_at_a_time(url, body, args.seconds, headers))
    with multiprocessing.Manager() as manager:
        outcomes = manager.dict()
        process = multiprocessing.Process(
            target=_attacker, args=(*attacker, outcome, args.rate, args.seconds, outcomes)
        )
        cpu0 = cpu_seconds(gw_pid)
        process.start()
        attacked = asyncio.run(one_at_a_time(url, body, args.seconds, headers))
        process.join()
        cpu = cpu_seconds(gw_pid) - cpu0
        got = dict(outcomes)
    q = statistics.quantiles
    return {
        "alone_p50": statistics.median(alone),
        "alone_p99": q(alone, n=100)[98],
        "attacked_p50": statistics.median(attacked),
        "attacked_p99": q(attacked, n=100)[98],
        "attacked_max": max(attacked),
        "slow": sum(1 for ms in attacked if ms > SLOW_MS),
        "victim_requests": len(attacked),
        "cpu_s": cpu,
    }, got


def medians(rounds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per target, the median of each figure over its rounds (and the rounds)."""
    return [
        {"target": t, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}, "rounds": runs}
        for t, runs in rounds.items()
    ]
