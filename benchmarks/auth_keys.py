"""What a request's API key costs to check, by the number of keys the config holds: CPU of
the gateway a served request (a valid key, 1 token) and a refused one (a wrong key: 401),
for this tree and, with `--base-src`, another checkout, side by side.

    python benchmarks/auth_keys.py                                   # ~2 min
    python benchmarks/auth_keys.py --base-src ../base/src --keys 1,10000,100000

A config may hold up to 100,000 keys (settings.MAX_API_KEYS). Each gateway runs in front of
one sim (TTFT 0) with a config of `--keys` keys (`auth.api_keys`, ~6 s to load 100,000);
clients present the last one listed. A refused request is what a stranger's costs: the key
is checked before any other work, so it is the check and the 401. Each round sends
`--requests` of each kind, `--concurrency` at a time, to each target in turn; the figure is
the median round's CPU us a request (psutil: the process and its children). JSON in
results/auth_keys.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
from typing import Any

import aiohttp
from _common import config_file, cpu_per_request, cpu_seconds, gateway, write_json

from tokenpipe.bench import procs
from tokenpipe.bench.procs import Service
from tokenpipe.control.auth import digest


def _config(keys: int) -> str:
    lines = ["auth:", "  api_keys:"]
    lines += [f"    - {{name: k{i}, sha256: {digest(f'sk-{i}')}}}" for i in range(keys)]
    return "\n".join(lines) + "\n"


async def _refused(svc: Service, requests: int, concurrency: int) -> float:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"Authorization": "Bearer sk-not-a-key"}
    left = iter(range(requests))
    before = cpu_seconds(svc.pid)
    async with aiohttp.ClientSession(svc.url) as session:

        async def client() -> None:
            for _ in left:
                async with session.post("/v1/chat/completions", json=body, headers=headers) as r:
                    await r.read()
                    if r.status != 401:
                        raise SystemExit(f"a wrong key got {r.status}, not 401")

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return (cpu_seconds(svc.pid) - before) / requests


async def _bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    targets = {"this tree": None, **({"base": args.base_src} if args.base_src else {})}
    with procs.sim("--ttft-ms", "0", "--itl-ms", "0") as sim:
        for keys in args.keys:
            config = config_file(f"auth-keys-{keys}", _config(keys))
            key = f"sk-{keys - 1}"
            with contextlib.ExitStack() as stack:
                gateways = {
                    name: stack.enter_context(gateway(sim.url, config=config, src=src))
                    for name, src in targets.items()
                }
                for svc in gateways.values():  # warm-up
                    await cpu_per_request(svc, args.concurrency, 200, api_key=key)
                    await _refused(svc, 200, args.concurrency)
                served: dict[str, list[float]] = {name: [] for name in gateways}
                refused: dict[str, list[float]] = {name: [] for name in gateways}
                for r in range(args.rounds):
                    names = list(gateways)[r % 2 :] + list(gateways)[: r % 2]
                    for name in names:
                        print(f"  {keys} keys, round {r + 1}/{args.rounds}, {name}", flush=True)
                        svc = gateways[name]
                        us = await cpu_per_request(
                            svc, args.concurrency, args.requests, api_key=key
                        )
                        served[name].append(us * 1e6)
                        refused[name].append(
                            await _refused(svc, args.requests, args.concurrency) * 1e6
                        )
            for name in gateways:
                rows.append(
                    {
                        "keys": keys,
                        "target": name,
                        "us_served": statistics.median(served[name]),
                        "us_refused": statistics.median(refused[name]),
                        "rounds_served": served[name],
                        "rounds_refused": refused[name],
                    }
                )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--keys",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 10_000, 100_000],
        help="numbers of keys in the config, comma-separated",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=1000, help="requests of each kind a round")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--base-src", help="add tokenpipe run from this src/ directory (PYTHONPATH)")
    p.add_argument("--json", default="results/auth_keys.json")
    args = p.parse_args()
    if min(args.keys) < 1:
        p.error("--keys: at least 1 key (without keys there is nothing to check)")
    rows = asyncio.run(_bench(args))
    print(f"\n{'keys':>7}  {'target':<10} {'us/served request':>18} {'us/refused request':>19}")
    for row in rows:
        print(
            f"{row['keys']:>7}  {row['target']:<10} {row['us_served']:18.0f} "
            f"{row['us_refused']:19.0f}"
        )
    write_json(args.json, "auth_keys", args, rows=rows)


if __name__ == "__main__":
    main()
