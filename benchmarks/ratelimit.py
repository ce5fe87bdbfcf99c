"""Rate limiting side by side: who turns an overloaded quota into the most useful work?

One run, the same rate-limited sim for every contender (a fresh sim each, so every bucket
starts full): `tokenpipe sim --rpm R --bucket-seconds D` enforces a real bucket and answers
429 with OpenAI headers past it. An app built on the official OpenAI SDK (its defaults:
2 retries honouring Retry-After) offers `--load` times the limit, open loop, for `--seconds`:

    naive       the SDK straight at the sim
    tokenpipe   through one gateway (nothing configured: limits learned from headers)
    tokenpipe3  through three gateways sharing one redis-server (load spread over them)
    litellm     through LiteLLM's proxy with the deployment's rpm/tpm set to the limit

Reported per contender: goodput (upstream successes started within the offered window, as a
share of what the bucket allowed in it: rate x seconds + depth), upstream 429s (count and
share of upstream requests), the app's success share and its p50/p99 latency. Ratios are
against the naive client. Prints a table and writes JSON.

    .venv/bin/python benchmarks/ratelimit.py                    # 30 s each, 3x the limit
    .venv/bin/python benchmarks/ratelimit.py --seconds 12 --only naive,tokenpipe

LiteLLM is installed on first use into .cache/litellm-venv (its own venv: its pins must not
touch ours); `--only` without it skips it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import litellm  # noqa: E402

from tests.redis_server import RedisServer, free_port  # noqa: E402
from tokenpipe.bench.procs import gateway, sim  # noqa: E402

MODEL = "sim-model"
CONTENDERS = ("naive", "tokenpipe", "tokenpipe3", "litellm")
#: Longest the app waits for its last requests after the offered window (seconds).
DRAIN = 120.0


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def offer(urls: list[str], rate: float, seconds: float) -> dict[str, Any]:
    """Open-loop load through AsyncOpenAI clients with their default settings."""
    clients = [openai.AsyncOpenAI(base_url=u, api_key="sk-bench") for u in urls]
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def one(client: openai.AsyncOpenAI) -> None:
        t = time.monotonic()
        try:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20
            )
            latencies.append(time.monotonic() - t)
        except openai.APIStatusError as e:
            errors[str(e.status_code)] = errors.get(str(e.status_code), 0) + 1
        except openai.APIError as e:
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1

    start = time.monotonic()
    n = int(rate * seconds)
    tasks = []
    for i in range(n):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(clients[i % len(clients)])))
    _, pending = await asyncio.wait(tasks, timeout=DRAIN)
    for t in pending:
        t.cancel()
    for c in clients:
        await c.close()
    return {
        "start": start,
        "offered": n,
        "ok": len(latencies),
        "errors": errors,
        "unfinished": len(pending),
        "p50_s": _quantile(latencies, 0.5),
        "p99_s": _quantile(latencies, 0.99),
        "median_s": statistics.median(latencies) if latencies else None,
    }


def sim_records(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url + "/sim/stats?last=100000", timeout=10) as r:
        return list(json.loads(r.read())["records"])


def _litellm(sim_url: str, port: int, rpm: float) -> subprocess.Popen[bytes]:
    config = (
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {sim_url}/v1\n"
        "      api_key: sk-sim\n"
        f"      rpm: {int(rpm)}\n"
    )
    # No master key: clients call it without one (loopback only).
    proc = litellm(
        "ratelimit", port, config, {"LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true"}
    )
    if proc is None:
        raise RuntimeError("LiteLLM proxy did not start; see .cache/litellm-ratelimit.log")
    return proc


async def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    rate = args.rpm / 60.0
    offered_rate = args.load * rate
    sim_args = (
        "--rpm",
        str(args.rpm),
        "--bucket-seconds",
        str(args.bucket_seconds),
        "--ttft-ms",
        "20",
        "--itl-ms",
        "1",
    )
    with sim(*sim_args) as s:
        if name == "naive":
            app = await offer([s.url + "/v1"], offered_rate, args.seconds)
        elif name == "tokenpipe":
            with gateway("--upstream", s.url + "/v1") as g:
                app = await offer([g.url + "/v1"], offered_rate, args.seconds)
        elif name == "tokenpipe3":
            with RedisServer() as redis:
                cfg = ROOT / ".cache" / "ratelimit-redis.yaml"
                cfg.write_text(f"limits:\n  backend: redis\n  redis: {{url: '{redis.url}'}}\n")
                gw = ("--upstream", s.url + "/v1", "--config", str(cfg))
                with gateway(*gw) as a, gateway(*gw) as b, gateway(*gw) as c:
                    urls = [x.url + "/v1" for x in (a, b, c)]
                    app = await offer(urls, offered_rate, args.seconds)
        else:
            port = free_port()
            proc = _litellm(s.url, port, args.rpm)
            try:
                app = await offer([f"http://127.0.0.1:{port}/v1"], offered_rate, args.seconds)
            finally:
                proc.terminate()
                proc.wait(20)
        recs = sim_records(s.url)
    end = app["start"] + args.seconds
    window = [r for r in recs if app["start"] <= r["started"] < end]
    ok_in = sum(1 for r in window if r["status"] == 200)
    allowed = rate * args.seconds + rate * args.bucket_seconds
    up_429 = sum(1 for r in recs if r["status"] == 429)
    return {
        "name": name,
        "goodput_share": ok_in / allowed,
        "upstream_ok_in_window": ok_in,
        "allowed_in_window": allowed,
        "upstream_requests": len(recs),
        "upstream_429": up_429,
        "upstream_429_share": up_429 / len(recs) if recs else 0.0,
        "app": app,
    }


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rpm", type=float, default=600.0, help="upstream requests per minute")
    p.add_argument("--bucket-seconds", type=float, default=2.0, help="upstream bucket depth")
    p.add_argument("--load", type=float, default=3.0, help="offered load, times the limit")
    p.add_argument("--seconds", type=float, default=30.0, help="offered window per contender")
    p.add_argument("--only", default=",".join(CONTENDERS), help="comma-separated contenders")
    p.add_argument("--json", default=str(ROOT / "results" / "ratelimit.json"))
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n]
    rows = []
    for name in names:
        print(f"running {name} ({args.seconds:g} s at {args.load:g}x the limit) ...", flush=True)
        rows.append(asyncio.run(run_one(name, args)))
    base = next((r for r in rows if r["name"] == "naive"), None)
    head = (
        f"{'contender':<11} {'goodput':>8} {'vs naive':>8} {'up 429':>7} {'429 share':>9} "
        f"{'app ok':>7} {'p50 s':>6} {'p99 s':>6}"
    )
    print(
        f"\nlimit {args.rpm:g} rpm, bucket {args.bucket_seconds:g} s deep, "
        f"offered {args.load:g}x for {args.seconds:g} s\n" + head + "\n" + "-" * len(head)
    )
    for r in rows:
        app = r["app"]
        ratio = f"{r['goodput_share'] / base['goodput_share']:.2f}x" if base else "-"
        print(
            f"{r['name']:<11} {r['goodput_share']:>8.1%} {ratio:>8} {r['upstream_429']:>7} "
            f"{r['upstream_429_share']:>9.1%} {app['ok'] / app['offered']:>7.1%} "
            f"{_fmt_s(app['p50_s']):>6} {_fmt_s(app['p99_s']):>6}"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
