"""The gateway's CPU a request at a steady, moderate rate: requests arriving open loop at
`--rate` a second (Poisson), each streaming `--tokens` tokens from the sim, for this tree,
another checkout (`--base-src`) and the bare aiohttp relay, rounds interleaved.

    python benchmarks/rate_cpu.py                             # ~2.5 min
    python benchmarks/rate_cpu.py --base-src ../base/src --rate 20 --seconds 20

relay_cost.py and request_cpu.py load the gateway until its core is full: work that runs by
the clock rather than per request (a latency view refreshed four times a second,
control/quantiles.py; the runtime sampler; idle timers) is then shared by thousands of
requests a second and vanishes from the figure. Most deployments see tens of requests a
second, where that work is a request's own: this figure is the gateway process's CPU (the
scheduler's count of its threads' time on a CPU) over a round, divided by the requests the
round sent, everything it did while idle between them included. The sim and the load
generator share the 2 cores, so read the targets against each other within a round (the
paired difference), not alone.
JSON in results/rate_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from _common import ROOT, bare_relay, cpu_ns, gateway, src_dir, write_json

from tokenpipe.bench import procs, run_load
from tokenpipe.bench.procs import Service


async def _round(svc: Service, args: argparse.Namespace, seed: int) -> float:
    """CPU us a request of `svc` over one round at the rate (after a warm-up of 20)."""
    url = svc.url + "/v1"
    await run_load(url, "sim-model", concurrency=4, requests=20, max_tokens=args.tokens)
    before = cpu_ns(svc.pid)
    result = await run_load(
        url,
        "sim-model",
        rate=args.rate,
        duration_s=args.seconds,
        max_tokens=args.tokens,
        prompt_tokens=32,
        seed=seed,
        concurrency=1024,
    )
    spent = (cpu_ns(svc.pid) - before) / 1e9
    done = len(result.records)
    failed = sum(1 for r in result.records if r.error)
    if failed:
        raise SystemExit(f"{failed} of {done} requests failed")
    return spent / done * 1e6


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    targets: dict[str, str | None] = {"this tree": None}
    if args.base_src:
        targets["base"] = args.base_src
    targets["bare relay"] = "relay"
    us: dict[str, list[float]] = {t: [] for t in targets}
    sim_args = ("--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms))
    with procs.sim(*sim_args) as sim:
        for i in range(args.rounds):
            print(f"  round {i + 1}/{args.rounds}", flush=True)
            for name, src in targets.items():
                svc = bare_relay(sim.url) if src == "relay" else gateway(sim.url, src=src)
                with svc:
                    us[name].append(await _round(svc, args, seed=i))
    return us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=20.0, help="a target's run a round")
    p.add_argument("--rate", type=float, default=20.0, help="requests a second")
    p.add_argument("--tokens", type=int, default=16, help="tokens a request")
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--base-src", type=src_dir, help="src/ of another checkout, measured too")
    p.add_argument("--json", default=str(ROOT / "results" / "rate_cpu.json"))
    args = p.parse_args()
    us = asyncio.run(_bench(args))
    print(f"\nCPU us a request at {args.rate:g} requests/s, {args.tokens} tokens each")
    print(f"{'target':<12}{'median':>9}{'(rounds)':>18}{'- this tree, paired':>22}")
    mine = us["this tree"]
    for name, v in us.items():
        diff = (
            ""
            if name == "this tree"
            else f"{statistics.median(b - a for a, b in zip(mine, v, strict=True)):+.0f}"
        )
        print(
            f"{name:<12}{statistics.median(v):>9.0f}{f'({min(v):.0f}-{max(v):.0f})':>18}{diff:>22}"
        )
    write_json(args.json, "rate_cpu", args, us=us)


if __name__ == "__main__":
    main()
