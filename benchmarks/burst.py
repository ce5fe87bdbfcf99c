"""A burst of streams starting together: what the gateway adds to their first token against
the sim directly, and how long they waited for the upstream's concurrency limit (a cold AIMD
limit starts at `limits.initial_concurrency`, 32).

    python benchmarks/burst.py                       # 1,000 streams, 10 tokens/s, 30 tokens
    python benchmarks/burst.py --base ../base/src    # + a gateway of another checkout

Each gateway is started fresh for its burst (a cold limit, as after a deploy), one target
after the other against the same sim; `--rounds` bursts per target, medians of the rounds.
`limiter wait` is the gateway's own `tokenpipe_limiter_wait_seconds`: its sum over the
burst's requests and the share of them that waited at all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import urllib.request
from collections.abc import Iterator

from _common import ROOT, gateway

from tokenpipe.bench import run_load
from tokenpipe.bench.procs import Service
from tokenpipe.serving import install_uvloop

MODEL = "sim-model"


def _limiter_wait(url: str) -> tuple[float, float, float]:
    """(sum of seconds, requests, requests that waited 0 s) of tokenpipe_limiter_wait_seconds."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    total = count = zero = 0.0
    for line in text.splitlines():
        if not line.startswith("tokenpipe_limiter_wait_seconds"):
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("tokenpipe_limiter_wait_seconds_sum"):
            total += float(value)
        elif name.startswith("tokenpipe_limiter_wait_seconds_count"):
            count += float(value)
        elif 'le="0.001"' in name:  # the first bucket edge: no wait to speak of
            zero += float(value)
    return total, count, zero


@contextlib.contextmanager
def _target(name: str, sim: Service, src: str | None) -> Iterator[tuple[str, Service | None]]:
    if name == "direct":
        yield sim.url, None
        return
    with gateway(sim.url, env={"PYTHONPATH": src} if src else None) as gw:
        yield gw.url, gw


async def _burst(url: str, args: argparse.Namespace) -> tuple[list[float], int, float, float]:
    """TTFTs (ms) of one burst, its failed requests, its output tokens/s, and its wall time."""
    result = await run_load(
        url + "/v1",
        MODEL,
        concurrency=args.streams,
        requests=args.streams,
        max_tokens=args.tokens,
        prompt_tokens=32,
        timeout_s=120,
    )
    ttfts = [r.ttft * 1e3 for r in result.records if r.ok and r.ttft is not None]
    failed = sum(1 for r in result.records if not r.ok)
    tokens = sum(r.output_tokens for r in result.records if r.ok)
    return ttfts, failed, tokens / max(result.wall_s, 1e-9), result.wall_s


async def _bench(args: argparse.Namespace) -> None:
    itl = 1000.0 / args.tokens_per_second
    sim_args = ("--ttft-ms", str(args.ttft_ms), "--itl-ms", f"{itl:g}")
    targets: dict[str, str | None] = {"direct": None, "tokenpipe": str(ROOT / "src")}
    if args.base:
        targets["base"] = args.base
    rows: dict[str, list[tuple[float, float, int, float, tuple[float, float, float]]]] = {}
    with Service("sim", "--port", "0", *sim_args, name="sim") as sim:
        for r in range(args.rounds):
            for name, src in targets.items():
                with _target(name, sim, src) as (url, gw):
                    ttfts, failed, tps, _ = await _burst(url, args)
                    wait = _limiter_wait(url) if gw is not None else (0.0, 0.0, 0.0)
                q = statistics.quantiles(ttfts, n=100)
                rows.setdefault(name, []).append((q[49], q[98], failed, tps, wait))
                print(f"  round {r + 1} {name}: p50 {q[49]:.0f} ms, p99 {q[98]:.0f} ms", flush=True)
    print(
        f"\n{args.streams} streams at once, {args.tokens} tokens at {args.tokens_per_second:g}/s, "
        f"TTFT {args.ttft_ms:g} ms at the sim; medians of {args.rounds} rounds"
    )
    direct = statistics.median(p50 for p50, *_ in rows["direct"])
    direct_tps = statistics.median(t for *_, t, _ in rows["direct"])
    print(
        f"{'target':<10} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>8} {'errors':>6} "
        f"{'x tok/s':>7} {'wait s':>7} {'waited':>7}"
    )
    for name, rs in rows.items():
        p50 = statistics.median(x[0] for x in rs)
        p99 = statistics.median(x[1] for x in rs)
        errors = sum(x[2] for x in rs)
        tps = statistics.median(x[3] for x in rs)
        wait_s = statistics.median(x[4][0] for x in rs)
        waited = statistics.median((x[4][1] - x[4][2]) / x[4][1] if x[4][1] else 0.0 for x in rs)
        print(
            f"{name:<10} {p50:7.0f} {p99:7.0f} {p50 - direct:+8.1f} {errors:6d} "
            f"{tps / direct_tps:7.2f} {wait_s:7.1f} {waited:7.0%}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=30)
    p.add_argument("--tokens-per-second", type=float, default=10.0)
    p.add_argument("--ttft-ms", type=float, default=100.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--base", help="src directory of a checkout to compare against")
    args = p.parse_args()
    if args.base:
        args.base = os.path.abspath(args.base)
    install_uvloop()
    asyncio.run(_bench(args))


if __name__ == "__main__":
    main()
