"""What finding a model's upstreams costs (router/candidates.py), by the size of the config:
a `Router.candidates` call alone, and the gateway's CPU a 1-token request, for this tree and,
with `--base-src`, another checkout, side by side.

    python benchmarks/router_candidates.py                          # ~2 min
    python benchmarks/router_candidates.py --base-src ../base/src

A request asks which upstreams serve its model two to four times (its API, usage, the
context window, its attempts' order). Each config has `U` upstreams naming `M` models each
(`U x M`: the request's model is named by the last upstream); a config may hold 1,000
upstreams of 10,000 names each (settings.MAX_UPSTREAMS, MAX_MODELS). The call is timed in
child processes (PYTHONPATH=its src), `--rounds` rounds interleaved, median us a call. The
request: each gateway in front of one sim (TTFT 0), its config's upstreams all pointing at
the sim, `--requests` 1-token requests a round, median CPU us a request (psutil). JSON in
results/router_candidates.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
from typing import Any

from _common import child_figure, cpu_per_request, gateway_with, src_targets, write_json

from tokenpipe.bench import procs

_CHILD = r"""
import asyncio, json, sys, time
from tokenpipe.router import Router
from tokenpipe.settings import UpstreamSettings
from tokenpipe.upstream.http import HttpUpstream

count, per, calls = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ups = [
    HttpUpstream(UpstreamSettings(
        name=f"u{i}", url=f"http://127.0.0.1:9/v1", models=[f"m{i}-{j}" for j in range(per)]
    ))
    for i in range(count)
]
router = Router(ups)
model = f"m{count - 1}-0"

async def main():
    for _ in range(10):
        await router.candidates(model)
    t = time.process_time_ns()
    for _ in range(calls):
        await router.candidates(model)
    return (time.process_time_ns() - t) / calls / 1e3

print(json.dumps(asyncio.run(main())))
"""


def _shape(text: str) -> tuple[int, int]:
    count, _, per = text.partition("x")
    return int(count), int(per)


def _config(count: int, per: int, sim_url: str) -> str:
    lines = ["upstreams:"]
    for i in range(count):
        models = ", ".join(f"m{i}-{j}" for j in range(per))
        lines.append(f"  - {{name: u{i}, url: '{sim_url}/v1', models: [{models}]}}")
    return "\n".join(lines) + "\n"


async def _gateways(
    args: argparse.Namespace, targets: dict[str, str | None]
) -> list[dict[str, Any]]:
    rows = []
    with procs.sim("--ttft-ms", "0", "--itl-ms", "0") as sim:
        for count, per in args.shapes:
            config = _config(count, per, sim.url)
            model = f"m{count - 1}-0"
            with contextlib.ExitStack() as stack:
                gws = {
                    name: stack.enter_context(gateway_with(f"router-{count}x{per}", config, src))
                    for name, src in targets.items()
                }
                for svc in gws.values():
                    await cpu_per_request(svc, 8, 200, model=model)  # warm-up
                figures: dict[str, list[float]] = {name: [] for name in gws}
                for r in range(args.rounds):
                    for name in list(gws)[r % 2 :] + list(gws)[: r % 2]:
                        print(f"  {count}x{per}, round {r + 1}/{args.rounds}, {name}", flush=True)
                        us = await cpu_per_request(gws[name], 8, args.requests, model=model) * 1e6
                        figures[name].append(us)
            for name, values in figures.items():
                rows.append({"shape": f"{count}x{per}", "target": name, "us_request": values})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--shapes",
        type=lambda text: [_shape(s) for s in text.split(",")],
        default=[(1, 1), (100, 3), (1000, 3), (100, 1000)],
        help="configs as UPSTREAMSxMODELS, comma-separated (default 1x1,100x3,1000x3,100x1000)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=2000, help="candidates calls timed a round")
    p.add_argument("--requests", type=int, default=600, help="1-token requests a round")
    p.add_argument("--base-src", help="add another checkout's src/ (PYTHONPATH)")
    p.add_argument("--json", default="results/router_candidates.json")
    args = p.parse_args()
    targets = src_targets(args.base_src)
    calls: list[dict[str, Any]] = []
    for count, per in args.shapes:
        figures: dict[str, list[float]] = {name: [] for name in targets}
        for r in range(args.rounds):
            for name in list(targets)[r % 2 :] + list(targets)[: r % 2]:
                n = max(10, args.calls // max(1, count * per // 300))  # slow ones fewer times
                figures[name].append(
                    child_figure(targets[name], _CHILD, str(count), str(per), str(n))
                )
        for name, values in figures.items():
            calls.append({"shape": f"{count}x{per}", "target": name, "us_call": values})
    gw_targets = {name: (None if name == "this tree" else src) for name, src in targets.items()}
    requests = asyncio.run(_gateways(args, gw_targets))
    print(f"\n{'upstreams x models':<19} {'target':<10} {'us a call':>10} {'us a request':>13}")
    for call, req in zip(calls, requests, strict=True):
        print(
            f"{call['shape']:<19} {call['target']:<10} {statistics.median(call['us_call']):10.1f}"
            f" {statistics.median(req['us_request']):13.0f}"
        )
    write_json(args.json, "router_candidates", args, calls=calls, requests=requests)


if __name__ == "__main__":
    main()
