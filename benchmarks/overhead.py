"""What a gateway costs: the client directly against the sim, through a bare byte-forwarding
relay (the floor for any Python gateway), through tokenpipe, and through LiteLLM's proxy.

All targets share one sim and run interleaved (round r runs the targets in a rotated order), so
machine noise lands on every target alike. Prints a table and writes JSON.

Users start staggered by default: spread evenly over one request's duration, so the load is
steady from the start, as a gateway's is in service. `--start burst` starts them together:
every round is then waves of simultaneous arrivals, and TTFT measures how fast a gateway works
through a queue of new requests (each one's CPU delays the ones behind it).

Besides pooled percentiles, each gateway's TTFT is compared with the bare relay's round by
round (the two ran one after the other): the median of those differences ("vs relay") is what
the targets are judged on, since the pooled figures of two targets drift apart with the
machine's noise; the 95% interval printed under the table is a bootstrap over rounds.
Tokens/s is the sum of each user's own rate (its tokens over its span).

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

`--features-off` adds tokenpipe with every optional layer off (limiter learning, adaptive
concurrency, deadlines, hedging, retries, breaker, recovery, context budgeting).
`--burn-us N` adds a target: the bare relay spinning N us of CPU per request. Where all 64
streams start together, each request's CPU delays the ones behind it, so this shows what a
gateway's per-request cost alone does to TTFT and throughput.

LiteLLM is installed on first use into .cache/litellm-venv (its own venv: its pins must not
touch ours); `--litellm off` skips it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    bare_relay,
    cpu_seconds,
    features_off_config,
    fmt,
    free_port,
    gateway,
    litellm,
    write_json,
)

from tokenpipe.bench import Summary, run_load
from tokenpipe.bench.procs import Service
from tokenpipe.serving import install_uvloop

ROOT = Path(__file__).resolve().parent.parent
MODEL = "sim-model"
#: The sim's gap between tokens when paced: 200 tokens/s per stream.
PACED_ITL_MS = 5.0
STARTS = ("staggered", "burst")
#: Resamples of the bootstrap interval of the differences to the relay (seeded: reproducible).
BOOTSTRAP = 2000
#: LiteLLM's proxy refuses to start without a master key; clients then must present it.
LITELLM_KEY = "sk-tokenpipe-bench-0123456789abcdef"


@dataclass
class Target:
    name: str
    url: str  # base URL with /v1
    pid: int | None  # the process whose CPU is the gateway's cost (None: direct)
    api_key: str | None = None
    summary: Summary = field(default_factory=Summary)
    cpu_s: float = 0.0
    #: Per round: (TTFT p50 ms, TTFT p99 ms, users' tokens/s).
    rounds: list[tuple[float, float, float]] = field(default_factory=list)


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


async def _run_target(
    t: Target, concurrency: int, requests: int, max_tokens: int, ramp_s: float, round_s: float
) -> None:
    cpu0 = cpu_seconds(t.pid)
    result = await run_load(
        t.url,
        MODEL,
        api_key=t.api_key,
        concurrency=concurrency,
        requests=None if round_s else requests,
        duration_s=round_s or None,
        max_tokens=max_tokens,
        prompt_tokens=32,
        label=t.name,
        ramp_s=ramp_s,
    )
    t.cpu_s += cpu_seconds(t.pid) - cpu0
    if round_s:  # steady load only: the ramp's requests met fewer streams than `concurrency`
        steady = result.started_at + ramp_s
        result.records = [r for r in result.records if r.sent_at >= steady]
    summary = result.summary()
    t.summary.merge(summary)
    ttft = summary.to_json()["ttft_ms"]
    t.rounds.append((ttft["p50"] or 0.0, ttft["p99"] or 0.0, result.users_tokens_per_s() or 0.0))


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _diffs(t: Target, relay: Target | None, i: int) -> list[float]:
    """Per round: t's figure `i` minus the relay's in the same round (none for the baselines)."""
    if relay is None or t is relay or t.pid is None:
        return []
    return [a[i] - b[i] for a, b in zip(t.rounds, relay.rounds, strict=True)]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _interval(xs: list[float]) -> list[float] | None:
    """Bootstrap 95% interval of the median of `xs` (resampling rounds)."""
    if len(xs) < 2:
        return None
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(BOOTSTRAP))
    return [meds[int(0.025 * BOOTSTRAP)], meds[int(0.975 * BOOTSTRAP) - 1]]


def _row(t: Target, base: Target, relay: Target | None) -> dict[str, Any]:
    s = t.summary
    j = s.to_json()
    b = base.summary.to_json()
    d50, d99 = _diffs(t, relay, 0), _diffs(t, relay, 1)
    tps = statistics.fmean(r[2] for r in t.rounds) if t.rounds else 0.0
    base_tps = statistics.fmean(r[2] for r in base.rounds) if base.rounds else 0.0
    return {
        "target": t.name,
        "ttft_p50_ms": j["ttft_ms"]["p50"],
        "ttft_p99_ms": j["ttft_ms"]["p99"],
        "added_ttft_p50_ms": _sub(j["ttft_ms"]["p50"], b["ttft_ms"]["p50"]),
        "added_ttft_p99_ms": _sub(j["ttft_ms"]["p99"], b["ttft_ms"]["p99"]),
        "vs_relay_ttft_p50_ms": _median(d50),
        "vs_relay_ttft_p99_ms": _median(d99),
        "vs_relay_ttft_p50_ci95_ms": _interval(d50),
        "vs_relay_ttft_p99_ci95_ms": _interval(d99),
        "rounds_ttft_p50_ms": [r[0] for r in t.rounds],
        "rounds_ttft_p99_ms": [r[1] for r in t.rounds],
        # Per token (chunk gap / tokens in it): comparable whether or not chunks were merged.
        "itl_p50_ms": j["itl_token_ms"]["p50"],
        "itl_p99_ms": j["itl_token_ms"]["p99"],
        "tokens_per_chunk": j["tokens_per_chunk"],
        "tokens_per_s": tps,
        "tokens_per_s_vs_direct": tps / (base_tps or 1.0),
        "cpu_s_per_1k_tokens": (t.cpu_s / s.output_tokens * 1000) if s.output_tokens else None,
        "requests_ok": j["requests_ok"],
        "requests_failed": j["requests_failed"],
    }


def _print(pace: str, start: str, concurrency: int, rows: list[dict[str, Any]]) -> None:
    print(f"\n== {pace}, concurrency {concurrency}, {start} start ==")
    print(
        f"{'target':<13} {'TTFT p50':>9} {'p99':>8} {'+p50':>7} {'+p99':>7} "
        f"{'vs relay p50':>12} {'p99':>7} "
        f"{'ITL/tok p50':>11} {'p99':>7} {'tok/chunk':>9} {'tok/s':>9} {'x direct':>8} "
        f"{'CPU s/1k':>8} {'fail':>5}"
    )
    for r in rows:
        print(
            f"{r['target']:<13} {fmt(r['ttft_p50_ms'], 9)} {fmt(r['ttft_p99_ms'], 8)} "
            f"{fmt(r['added_ttft_p50_ms'], 7)} {fmt(r['added_ttft_p99_ms'], 7)} "
            f"{fmt(r['vs_relay_ttft_p50_ms'], 12)} {fmt(r['vs_relay_ttft_p99_ms'], 7)} "
            f"{fmt(r['itl_p50_ms'], 11, 3)} {fmt(r['itl_p99_ms'], 7, 3)} "
            f"{fmt(r['tokens_per_chunk'], 9)} {fmt(r['tokens_per_s'], 9, 0)} "
            f"{fmt(r['tokens_per_s_vs_direct'], 8)} {fmt(r['cpu_s_per_1k_tokens'], 8, 3)} "
            f"{r['requests_failed']:5d}"
        )
    for r in rows:
        ci50, ci99 = r["vs_relay_ttft_p50_ci95_ms"], r["vs_relay_ttft_p99_ci95_ms"]
        if ci50 is not None and ci99 is not None:
            print(
                f"{r['target']} vs relay, 95% interval over rounds: "
                f"p50 [{ci50[0]:+.1f}, {ci50[1]:+.1f}] ms, p99 [{ci99[0]:+.1f}, {ci99[1]:+.1f}] ms"
            )


async def _bench_one(
    args: argparse.Namespace, pace: str, start: str, concurrency: int, endpoints: list[Target]
) -> dict[str, Any]:
    """One table: every target at one pace, start and concurrency, interleaved in rounds.
    `endpoints`: direct first, the bare relay second (the baselines); each table gets fresh
    tallies of them."""
    itl_ms = PACED_ITL_MS if pace == "paced" else 0.0
    # Staggered: users spread over one request's duration (TTFT + tokens x ITL).
    ramp_s = (args.ttft_ms + args.max_tokens * itl_ms) / 1000 if start == "staggered" else 0.0
    targets = [Target(e.name, e.url, e.pid, e.api_key) for e in endpoints]
    requests = concurrency * args.requests_per_user
    for t in targets:  # warm-up: connections, caches, JIT-free but lazy imports
        await run_load(
            t.url,
            MODEL,
            api_key=t.api_key,
            concurrency=concurrency,
            requests=concurrency,
            max_tokens=8,
            prompt_tokens=32,
        )
    for r in range(args.rounds):
        order = targets[r % len(targets) :] + targets[: r % len(targets)]
        for t in order:
            print(
                f"  {pace} {start} c={concurrency} round {r + 1}/{args.rounds} {t.name}",
                flush=True,
            )
            await _run_target(t, concurrency, requests, args.max_tokens, ramp_s, args.round_s)
    rows = [_row(t, targets[0], targets[1]) for t in targets]
    _print(pace, start, concurrency, rows)
    return {"pace": pace, "start": start, "concurrency": concurrency, "rows": rows}


async def _bench_pace(pace: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    itl = f"{PACED_ITL_MS:g}" if pace == "paced" else "0"  # paced, or as fast as possible
    out: list[dict[str, Any]] = []
    with (
        Service(
            "sim", "--port", "0", "--ttft-ms", str(args.ttft_ms), "--itl-ms", itl, name="sim"
        ) as sim,
        bare_relay(sim.url) as relay,
        gateway(sim.url) as gw,
        bare_relay(sim.url, args.burn_us) if args.burn_us else contextlib.nullcontext() as burn,
        gateway(sim.url, config=features_off_config())
        if args.features_off
        else contextlib.nullcontext() as off,
    ):
        endpoints = [
            Target("direct", sim.url + "/v1", None),
            Target("bare-relay", relay.url + "/v1", relay.pid),
            Target("tokenpipe", gw.url + "/v1", gw.pid),
        ]
        if off is not None:
            endpoints.append(Target("tokenpipe-off", off.url + "/v1", off.pid))
        if burn is not None:
            endpoints.append(Target(f"relay+{args.burn_us:g}us", burn.url + "/v1", burn.pid))
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


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more seconds")
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
    p.add_argument("--litellm", choices=["auto", "off"], default="auto")
    p.add_argument(
        "--features-off", action="store_true", help="add tokenpipe with every optional layer off"
    )
    p.add_argument(
        "--burn-us", type=float, default=0.0, help="add a relay spinning this CPU per request"
    )
    p.add_argument("--json", default=str(ROOT / "results" / "overhead.json"))
    args = p.parse_args()
    install_uvloop()
    results: list[dict[str, Any]] = []
    for pace in args.pace.split(","):
        results += asyncio.run(_bench_pace(pace, args))
    write_json(args.json, "overhead", args, results=results)


if __name__ == "__main__":
    main()
