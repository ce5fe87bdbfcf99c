"""What overhead.py's tables share: the targets, their interleaved rounds, and the statistics
of each target against the baselines (the pooled figures, and the per-round differences to
direct and to the bare relay with bootstrap intervals). See overhead.py's docstring for why
rounds."""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

from _common import cpu_seconds

from tokenpipe.bench import Summary, run_load

MODEL = "sim-model"
#: The sim's gap between tokens when paced (overhead.py's `--itl-ms` default): 200 tokens/s
#: per stream.
PACED_ITL_MS = 5.0
#: Resamples of the bootstrap interval of the differences to the relay (seeded: reproducible).
BOOTSTRAP = 2000


@dataclass
class Target:
    name: str
    url: str  # base URL with /v1
    pid: int | None  # the process whose CPU is the gateway's cost (None: direct)
    api_key: str | None = None
    #: The API the client speaks to it (bench/apis.py).
    api: str = "chat"
    summary: Summary = field(default_factory=Summary)
    cpu_s: float = 0.0
    #: Requests sent in the rounds (the ramp's included: they cost CPU too).
    requests: int = 0
    #: Per round: (TTFT p50 ms, TTFT p99 ms, users' tokens/s).
    rounds: list[tuple[float, float, float]] = field(default_factory=list)

    def fresh(self) -> Target:
        """The same endpoint with empty tallies (each table counts its own)."""
        return Target(self.name, self.url, self.pid, self.api_key, self.api)


async def run_target(
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
        api=t.api,
    )
    t.cpu_s += cpu_seconds(t.pid) - cpu0
    t.requests += len(result.records)
    if round_s:  # steady load only: the ramp's requests met fewer streams than `concurrency`
        steady = result.started_at + ramp_s
        result.records = [r for r in result.records if r.sent_at >= steady]
    summary = result.summary()
    t.summary.merge(summary)
    ttft = summary.to_json()["ttft_ms"]
    t.rounds.append((ttft["p50"] or 0.0, ttft["p99"] or 0.0, result.users_tokens_per_s() or 0.0))


def itl_ms(args: argparse.Namespace, pace: str) -> float:
    """The sim's gap between tokens: `--itl-ms` when paced, none (as fast as the socket takes
    them) when unpaced."""
    return float(args.itl_ms) if pace == "paced" else 0.0


def ramp_seconds(args: argparse.Namespace, pace: str, start: str) -> float:
    """Staggered: users spread over one request's duration (TTFT + tokens x ITL)."""
    gap_ms = itl_ms(args, pace)
    return (args.ttft_ms + args.max_tokens * gap_ms) / 1000 if start == "staggered" else 0.0


async def run_rounds(
    args: argparse.Namespace, title: str, targets: list[Target], concurrency: int, ramp_s: float
) -> None:
    """Warms every target up, then runs `args.rounds` rounds of all of them, each round in
    an order rotated by one (machine noise lands on every target alike)."""
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
            api=t.api,
        )
    for r in range(args.rounds):
        order = targets[r % len(targets) :] + targets[: r % len(targets)]
        for t in order:
            print(f"  {title} round {r + 1}/{args.rounds} {t.name}", flush=True)
            await run_target(t, concurrency, requests, args.max_tokens, ramp_s, args.round_s)


def sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def diffs(t: Target, base: Target | None, i: int) -> list[float]:
    """Per round: t's figure `i` minus base's in the same round (none for the baselines)."""
    if base is None or t is base or t.pid is None:
        return []
    return [a[i] - b[i] for a, b in zip(t.rounds, base.rounds, strict=True)]


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def interval(xs: list[float]) -> list[float] | None:
    """Bootstrap 95% interval of the median of `xs` (resampling rounds)."""
    if len(xs) < 2:
        return None
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(BOOTSTRAP))
    return [meds[int(0.025 * BOOTSTRAP)], meds[int(0.975 * BOOTSTRAP) - 1]]


def row(t: Target, base: Target, relay: Target | None) -> dict[str, Any]:
    """A target's figures; `base` is direct, `relay` the bare relay of the same table."""
    s = t.summary
    j = s.to_json()
    b = base.summary.to_json()
    d50, d99 = diffs(t, relay, 0), diffs(t, relay, 1)
    v50, v99 = diffs(t, base, 0), diffs(t, base, 1)
    tps = statistics.fmean(r[2] for r in t.rounds) if t.rounds else 0.0
    base_tps = statistics.fmean(r[2] for r in base.rounds) if base.rounds else 0.0
    return {
        "target": t.name,
        "ttft_p50_ms": j["ttft_ms"]["p50"],
        "ttft_p99_ms": j["ttft_ms"]["p99"],
        "added_ttft_p50_ms": sub(j["ttft_ms"]["p50"], b["ttft_ms"]["p50"]),
        "added_ttft_p99_ms": sub(j["ttft_ms"]["p99"], b["ttft_ms"]["p99"]),
        "vs_relay_ttft_p50_ms": median(d50),
        "vs_relay_ttft_p99_ms": median(d99),
        "vs_relay_ttft_p50_ci95_ms": interval(d50),
        "vs_relay_ttft_p99_ci95_ms": interval(d99),
        # Added TTFT as the targets read it: per round against direct, then the median.
        "vs_direct_ttft_p50_ms": median(v50),
        "vs_direct_ttft_p99_ms": median(v99),
        "vs_direct_ttft_p50_ci95_ms": interval(v50),
        "vs_direct_ttft_p99_ci95_ms": interval(v99),
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
