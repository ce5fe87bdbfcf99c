"""What a gateway costs: the client directly against the sim, through a bare byte-forwarding
relay (the floor for any Python gateway), through tokenpipe, and through LiteLLM's proxy.

All targets share one sim and run interleaved (round r runs the targets in a rotated order), so
machine noise lands on every target alike. Prints a table and writes JSON.

Users start staggered by default: spread evenly over one request's duration, so the load is
steady from the start, as a gateway's is in service. `--start burst` starts them together:
every round is then waves of simultaneous arrivals, and TTFT measures how fast a gateway works
through a queue of new requests (each one's CPU delays the ones behind it).

Besides pooled percentiles, each target's TTFT is compared with direct's and each gateway's
with the bare relay's round by round (they ran one after the other): the medians of those
differences ("vs direct", the added TTFT; "vs relay") are what the targets are judged on,
since the pooled figures of two targets drift apart with the machine's noise; the 95%
intervals printed under the table are a bootstrap over rounds. Tokens/s is the sum of each
user's own rate (its tokens over its span).

Paced, the sim sends a role chunk at once, the first delta at `--ttft-ms` and then one delta
(token) every `--itl-ms` (default 5: 200 tokens/s per stream) up to `--max-tokens`; unpaced,
the deltas follow the first as fast as the socket takes them.

`--round-s S` makes each round S seconds of load per target instead of a fixed number of
requests, counting only requests sent once the ramp is over (steady load). A round's p50 moves
with the machine's hiccups during it; that spread shrinks with the round's length, so long
rounds are how a difference to the relay gets resolved to a millisecond or two on this machine.

    python benchmarks/overhead.py                      # paced (200 tokens/s/stream) and unpaced
    python benchmarks/overhead.py --litellm off --pace paced --concurrency 64 --rounds 12
    python benchmarks/overhead.py --litellm off --pace paced --concurrency 64 --round-s 20 \
        --rounds 40                                    # ~45 min: below a millisecond or two
    python benchmarks/overhead.py --litellm off --pace paced --concurrency 64 --start burst
    python benchmarks/overhead.py --litellm off --concurrency 64 --rounds 5
    python benchmarks/overhead.py --litellm off --pace paced --concurrency 64 --burn-us 700
    python benchmarks/overhead.py --litellm off --pace paced --concurrency 64 --features-off
    python benchmarks/overhead.py --litellm off --pace paced --concurrency 1 --itl-ms 20 \
        --max-tokens 64 --base-src ../base/src   # added TTFT at concurrency 1, before/after

`--features-off` adds tokenpipe with every optional layer off (limiter learning, adaptive
concurrency, deadlines, hedging, retries, breaker, recovery, context budgeting).
`--base-src PATH` adds "tokenpipe-base": the same gateway run from another checkout's src/
directory (on its PYTHONPATH), for before/after in one run on the same sim.
`--nginx` adds nginx as a streaming reverse proxy (benchmarks/_nginx.py): a compiled hop with
no features, on this machine, beside the Python ones.
`--burn-us N` adds a target: the bare relay spinning N us of CPU per request. Where all 64
streams start together, each request's CPU delays the ones behind it, so this shows what a
gateway's per-request cost alone does to TTFT and throughput.

LiteLLM is installed on first use into .cache/litellm-venv (its own venv: its pins must not
touch ours); `--litellm off` skips it.

`--api chat,responses,messages` (any of them) makes the table per client API instead
(overhead_apis.py): for each API the client against the sim in that API, the bare relay,
tokenpipe passing it through natively and tokenpipe translating it onto the other API's
upstream (chat onto Anthropic Messages; Responses and Messages onto OpenAI chat), with TTFT
against the bare relay, translated against native, and the gateway's CPU per request:

    python benchmarks/overhead.py --api chat,responses,messages --litellm off --pace paced \
        --concurrency 16 --round-s 10 --rounds 20     # ~50 min: 12 targets a round
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
from pathlib import Path
from typing import Any

import _nginx
from _common import (
    bare_relay,
    features_off_config,
    fmt,
    free_port,
    gateway,
    litellm,
    src_dir,
    write_json,
)
from _overhead import MODEL, PACED_ITL_MS, Target, itl_ms, ramp_seconds, row, run_rounds
from overhead_apis import GATEWAYS
from overhead_apis import bench_pace as bench_apis

from tokenpipe.bench.procs import Service
from tokenpipe.serving import install_uvloop

ROOT = Path(__file__).resolve().parent.parent
STARTS = ("staggered", "burst")
#: LiteLLM's proxy refuses to start without a master key; clients then must present it.
LITELLM_KEY = "sk-tokenpipe-bench-0123456789abcdef"


def _litellm(sim_url: str, port: int) -> subprocess.Popen[bytes] | None:
    """LiteLLM's proxy in front of the sim (None when it cannot run: the run goes on without)."""
    config = (
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {sim_url}/v1\n"
        "      api_key: sk-none\n"
        "litellm_settings:\n"
        "  num_retries: 0\n"
    )
    return litellm("overhead", port, config, {"LITELLM_MASTER_KEY": LITELLM_KEY})


def _diff(median: float | None, ci: list[float] | None) -> str:
    """A per-round difference: its median and, from 2 rounds on, its 95% interval."""
    if median is None:
        return "-"
    return f"{median:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci is not None else "")


def _print(title: str, rows: list[dict[str, Any]]) -> None:
    """The table in two parts and the per-round differences under it, within 80 columns."""
    print(f"\n== {title} ==")
    print(
        f"{'target':<14} {'TTFT p50':>9} {'p99':>8} {'+p50':>7} {'+p99':>7} "
        f"{'vs relay p50':>12} {'p99':>7} {'fail':>5}"
    )
    for r in rows:
        print(
            f"{r['target']:<14} {fmt(r['ttft_p50_ms'], 9)} {fmt(r['ttft_p99_ms'], 8)} "
            f"{fmt(r['added_ttft_p50_ms'], 7)} {fmt(r['added_ttft_p99_ms'], 7)} "
            f"{fmt(r['vs_relay_ttft_p50_ms'], 12)} {fmt(r['vs_relay_ttft_p99_ms'], 7)} "
            f"{r['requests_failed']:5d}"
        )
    print(
        f"\n{'target':<14} {'ITL/tok p50':>11} {'p99':>7} {'tok/chunk':>9} {'tok/s':>9} "
        f"{'x direct':>8} {'CPU s/1k':>8}"
    )
    for r in rows:
        print(
            f"{r['target']:<14} {fmt(r['itl_p50_ms'], 11, 3)} {fmt(r['itl_p99_ms'], 7, 3)} "
            f"{fmt(r['tokens_per_chunk'], 9)} {fmt(r['tokens_per_s'], 9, 0)} "
            f"{fmt(r['tokens_per_s_vs_direct'], 8)} {fmt(r['cpu_s_per_1k_tokens'], 8, 3)}"
        )
    for against in ("direct", "relay"):
        diffs = [r for r in rows if r[f"vs_{against}_ttft_p50_ms"] is not None]
        if not diffs:
            continue
        print(f"\nTTFT vs {against}, ms: median of per-round differences [95% interval]")
        print(f"{'target':<14} {'p50':>24} {'p99':>24}")
        for r in diffs:
            k = f"vs_{against}_ttft"
            print(
                f"{r['target']:<14} {_diff(r[f'{k}_p50_ms'], r[f'{k}_p50_ci95_ms']):>24} "
                f"{_diff(r[f'{k}_p99_ms'], r[f'{k}_p99_ci95_ms']):>24}"
            )


async def _bench_one(
    args: argparse.Namespace, pace: str, start: str, concurrency: int, endpoints: list[Target]
) -> dict[str, Any]:
    """One table: every target at one pace, start and concurrency, interleaved in rounds.
    `endpoints`: direct first, the bare relay second (the baselines); each table gets fresh
    tallies of them."""
    targets = [e.fresh() for e in endpoints]
    ramp_s = ramp_seconds(args, pace, start)
    await run_rounds(args, f"{pace} {start} c={concurrency}", targets, concurrency, ramp_s)
    rows = [row(t, targets[0], targets[1]) for t in targets]
    gap = f" (ITL {itl_ms(args, pace):g} ms)" if pace == "paced" else ""
    rounds = f"{args.rounds} round{'s' if args.rounds != 1 else ''}"
    _print(f"{pace}{gap}, concurrency {concurrency}, {start} start, {rounds}", rows)
    return {"pace": pace, "start": start, "concurrency": concurrency, "rows": rows}


async def _bench_pace(pace: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    itl = f"{itl_ms(args, pace):g}"  # paced, or as fast as possible
    out: list[dict[str, Any]] = []
    with (
        Service(
            "sim", "--port", "0", "--ttft-ms", str(args.ttft_ms), "--itl-ms", itl, name="sim"
        ) as sim,
        bare_relay(sim.url) as relay,
        gateway(sim.url) as gw,
        gateway(sim.url, src=args.base_src) if args.base_src else contextlib.nullcontext() as base,
        bare_relay(sim.url, args.burn_us) if args.burn_us else contextlib.nullcontext() as burn,
        gateway(sim.url, config=features_off_config())
        if args.features_off
        else contextlib.nullcontext() as off,
        _nginx.proxy(sim.url) if args.nginx else contextlib.nullcontext() as nginx,
    ):
        endpoints = [
            Target("direct", sim.url + "/v1", None),
            Target("bare-relay", relay.url + "/v1", relay.pid),
            Target("tokenpipe", gw.url + "/v1", gw.pid),
        ]
        if base is not None:
            endpoints.append(Target("tokenpipe-base", base.url + "/v1", base.pid))
        if off is not None:
            endpoints.append(Target("tokenpipe-off", off.url + "/v1", off.pid))
        if burn is not None:
            endpoints.append(Target(f"relay+{args.burn_us:g}us", burn.url + "/v1", burn.pid))
        if nginx is not None:
            endpoints.append(Target("nginx", nginx.url + "/v1", nginx.pid))
        litellm = None
        if args.litellm != "off":
            port = free_port()
            litellm = _litellm(sim.url, port)
            if litellm is not None:
                url = f"http://127.0.0.1:{port}/v1"
                endpoints.append(Target("litellm", url, litellm.pid, LITELLM_KEY))
        try:
            for start in args.start:
                for concurrency in args.concurrency:
                    out.append(await _bench_one(args, pace, start, concurrency, endpoints))
        finally:
            if litellm is not None:
                litellm.terminate()
                litellm.wait(10)
    return out


def _starts(text: str) -> list[str]:
    starts = [s.strip() for s in text.split(",")]
    if not starts or any(s not in STARTS for s in starts):
        raise argparse.ArgumentTypeError(f"use {' or '.join(STARTS)}, or both comma-separated")
    return starts


def _apis(text: str) -> list[str]:
    apis = list(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    if not apis or any(a not in GATEWAYS for a in apis):
        raise argparse.ArgumentTypeError(f"use any of {', '.join(GATEWAYS)}, comma-separated")
    return apis


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more seconds")
    return value


def _millis(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more milliseconds")
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64]
    )
    p.add_argument("--pace", default="paced,unpaced", help="paced, unpaced or both")
    p.add_argument(
        "--start",
        default="staggered",
        type=_starts,
        help="staggered (users spread over one request's duration), burst (all at once), or both",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests-per-user", type=int, default=3)
    p.add_argument(
        "--round-s",
        type=_seconds,
        default=0.0,
        help="seconds of load per target and round, counted after the ramp "
        "(default 0: --requests-per-user requests per user)",
    )
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument(
        "--itl-ms",
        type=_millis,
        default=PACED_ITL_MS,
        help=f"the sim's gap between tokens when paced (default {PACED_ITL_MS:g})",
    )
    p.add_argument("--litellm", choices=["auto", "off"], default="auto")
    p.add_argument(
        "--features-off", action="store_true", help="add tokenpipe with every optional layer off"
    )
    p.add_argument(
        "--burn-us", type=float, default=0.0, help="add a relay spinning this CPU per request"
    )
    p.add_argument(
        "--nginx",
        action="store_true",
        help="add nginx as a streaming proxy (_nginx.proxy): a compiled hop, no features",
    )
    p.add_argument(
        "--base-src",
        type=src_dir,
        metavar="PATH",
        help="add tokenpipe-base: the gateway run from this src/ directory (PYTHONPATH)",
    )
    p.add_argument(
        "--api",
        type=_apis,
        default=None,
        help="the per-API table for these APIs (chat,responses,messages): direct, bare relay, "
        "tokenpipe native and translated\n(default: chat only, in the table of direct, "
        "bare relay, tokenpipe and LiteLLM)",
    )
    p.add_argument("--json", default=str(ROOT / "results" / "overhead.json"))
    args = p.parse_args()
    if args.api is not None and (args.features_off or args.burn_us or args.base_src or args.nginx):
        p.error(
            "--features-off, --burn-us, --base-src and --nginx add rows to the chat table "
            "(without --api)"
        )
    if args.nginx and _nginx.binary() is None:
        p.error("--nginx needs nginx (Debian: apt-get install nginx-light)")
    if args.api is not None and args.itl_ms != PACED_ITL_MS:
        p.error(f"--itl-ms: the per-API table is paced at {PACED_ITL_MS:g} ms (without --api)")
    if args.api is not None and args.litellm == "auto":
        print("--api: LiteLLM is not run (it has a row in the chat table, without --api)")
    bench = _bench_pace if args.api is None else bench_apis
    install_uvloop()
    results: list[dict[str, Any]] = []
    for pace in args.pace.split(","):
        results += asyncio.run(bench(pace, args))
    write_json(args.json, "overhead", args, results=results)


if __name__ == "__main__":
    main()
