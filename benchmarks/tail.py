"""Tail-latency control side by side: each feature off and on, in one run.

The issue's scale: 10 requests/s open loop, 40 ms TTFT, 5% of requests stalled 3 s before
their first token (`tokenpipe sim --fault stall-first:3000@0.05`, the same seed for every
contender, a fresh sim each). Contenders, all streamed chat:

    direct      the client straight at the sim
    off         through the gateway, every tail feature switched off
    deadlines   adaptive TTFT deadline + retries only (floor 2 s: a stall is cut at 2 s)
    hedging     hedged first tokens only
    all         the defaults (deadlines, retries, hedging, recovery, breaker all on)
    all+hedge10 the defaults with a 10% hedge budget

and a mid-stream scenario on text completions, 5% of streams reset after 20 tokens, two
seeded sims behind the gateway: `recovery off` vs `recovery on` (share of answers complete
and identical to an uninterrupted one).

Reported: p50/p99/p99.9 TTFT and total latency (client side), errors, extra upstream
requests (sim requests / client requests - 1, warm-up excluded). Ratios against `direct`.
Prints a table and writes JSON (`--json`, default results/tail.json).

    .venv/bin/python benchmarks/tail.py                      # 200 requests each, ~2 minutes
    .venv/bin/python benchmarks/tail.py --requests 100 --only direct,all
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import cpu_seconds  # noqa: E402

from tokenpipe import sse  # noqa: E402
from tokenpipe.bench.procs import Service, gateway, sim  # noqa: E402

MODEL = "sim-model"
OFF = """
tail:
  deadlines: false
  retries: {enabled: false}
  hedging: {enabled: false}
  recovery: {enabled: false}
  breaker: {enabled: false}
"""
CONFIGS = {
    "off": OFF,
    "deadlines": """
tail:
  hedging: {enabled: false}
  recovery: {enabled: false}
  breaker: {enabled: false}
""",
    "hedging": """
tail:
  deadlines: false
  retries: {enabled: false}
  recovery: {enabled: false}
  breaker: {enabled: false}
""",
    "all": "",
    # The hedge budget must exceed the share of stalls for hedging to cover them all: at the
    # default 5% and 5% stalled, the budget runs dry in every 10 s window with more stalls.
    "all+hedge10": """
tail:
  hedging: {budget_ratio: 0.1}
""",
}
CONTENDERS = ("direct", *CONFIGS)
WARMUP = 30  # requests before measuring: the estimates need 20 samples


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Outcome:
    __slots__ = ("error", "text", "total", "ttft")

    def __init__(self) -> None:
        self.ttft: float | None = None
        self.total = 0.0
        self.error = ""
        self.text = ""


async def _one(s: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> Outcome:
    out = Outcome()
    t0 = time.perf_counter()
    parts: list[str] = []
    try:
        async with s.post(url + path, json=body) as r:
            if r.status != 200:
                out.error = f"status {r.status}"
                await r.read()
                return out
            dec = sse.SSEDecoder()
            async for chunk in r.content.iter_any():
                for ev in dec.feed(chunk):
                    if ev.comment or ev.data == sse.DONE:
                        continue
                    obj = orjson.loads(ev.data)
                    if "error" in obj:
                        out.error = str(obj["error"].get("code"))
                        continue
                    for ch in obj.get("choices") or ():
                        delta = ch.get("delta")
                        text = (delta or {}).get("content") if delta is not None else ch.get("text")
                        if text:
                            if out.ttft is None:
                                out.ttft = time.perf_counter() - t0
                            parts.append(text)
    except (aiohttp.ClientError, TimeoutError) as e:
        out.error = type(e).__name__
    out.total = time.perf_counter() - t0
    out.text = "".join(parts)
    return out


async def _offer(url: str, path: str, bodies: list[dict[str, Any]], rate: float) -> list[Outcome]:
    """Open loop: request i starts at i / rate seconds, whatever the earlier ones do."""
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        start = time.perf_counter()

        async def at(i: int, body: dict[str, Any]) -> Outcome:
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            return await _one(s, url, path, body)

        return list(await asyncio.gather(*(at(i, b) for i, b in enumerate(bodies))))


async def _sim_requests(s: Service) -> int:
    async with aiohttp.ClientSession() as c, c.get(s.url + "/sim/stats?last=0") as r:
        return int((await r.json())["requests"])


def _cfg(tmp: Path, name: str, upstreams: list[Service], tail: str) -> str:
    lines = ["upstreams:"]
    for i, u in enumerate(upstreams):
        lines += [f"  - name: u{i}", f"    url: {u.url}/v1"]
    path = tmp / f"{name.replace(' ', '-').replace(',', '').replace('%', '')}.yaml"
    path.write_text("\n".join(lines) + "\n" + tail)
    return str(path)


def _row(name: str, outs: list[Outcome], sent: int, n: int) -> dict[str, Any]:
    ok = [o for o in outs if not o.error]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    total = [o.total for o in ok]
    return {
        "name": name,
        "requests": n,
        "errors": len(outs) - len(ok),
        "ttft_p50": _q(ttft, 0.5),
        "ttft_p99": _q(ttft, 0.99),
        "ttft_p999": _q(ttft, 0.999),
        "total_p50": _q(total, 0.5),
        "total_p99": _q(total, 0.99),
        "total_p999": _q(total, 0.999),
        "extra_upstream": sent / n - 1,
    }


async def stalls(args: argparse.Namespace, tmp: Path, only: set[str]) -> list[dict[str, Any]]:
    timing = (
        "--ttft-ms", "40", "--itl-ms", "5", "--output-tokens", str(args.tokens),
        "--seed", "7", "--fault", "stall-first:3000@0.05",
    )  # fmt: skip
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    rows = []
    for name in CONTENDERS:
        if name not in only:
            continue
        with sim(*timing) as s:
            if name == "direct":
                url = s.url
                await _offer(url, "/v1/chat/completions", [body] * WARMUP, args.rate)
                before = await _sim_requests(s)
                outs = await _offer(url, "/v1/chat/completions", [body] * args.requests, args.rate)
                sent = await _sim_requests(s) - before
            else:
                with gateway("--config", _cfg(tmp, name, [s], CONFIGS[name])) as g:
                    await _offer(g.url, "/v1/chat/completions", [body] * WARMUP, args.rate)
                    before = await _sim_requests(s)
                    outs = await _offer(
                        g.url, "/v1/chat/completions", [body] * args.requests, args.rate
                    )
                    sent = await _sim_requests(s) - before
        rows.append(_row(name, outs, sent, args.requests))
        print(f"  {name}: done", file=sys.stderr)
    return rows


async def midstream(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Text completions, 5% of streams reset after 20 tokens; the answer must be whole."""
    n = args.requests
    bodies = [
        {"model": MODEL, "stream": True, "max_tokens": 60, "prompt": f"story number {i}"}
        for i in range(n)
    ]
    timing = ("--ttft-ms", "40", "--itl-ms", "5", "--seed", "11")
    rows = []
    with sim(*timing) as clean:
        expected = await _offer(clean.url, "/v1/completions", bodies, args.rate * 4)
    for name, tail in (("recovery off", OFF), ("recovery on", "")):
        with (
            sim(*timing, "--fault", "reset:20@0.05") as a,
            sim(*timing, "--fault", "reset:20@0.05") as b,
            gateway("--config", _cfg(tmp, name.replace(" ", "-"), [a, b], tail)) as g,
        ):
            outs = await _offer(g.url, "/v1/completions", bodies, args.rate)
            sent = await _sim_requests(a) + await _sim_requests(b)
        row = _row(name, outs, sent, n)
        row["complete_identical"] = (
            sum(1 for o, e in zip(outs, expected, strict=True) if not o.error and o.text == e.text)
            / n
        )
        rows.append(row)
        print(f"  {name}: done", file=sys.stderr)
    return rows


async def cost(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """What the tail layer costs when nothing goes wrong: gateway CPU per streamed request
    (500 tokens, as fast as the sim sends them, 16 at a time), every feature off vs on."""
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 500,
        "messages": [{"role": "user", "content": "hi"}],
    }
    n = args.requests
    rows = []
    with sim("--ttft-ms", "5", "--itl-ms", "0") as s:
        for name, tail in (("tail off", OFF), ("tail on", "")):
            with gateway("--config", _cfg(tmp, "cost-" + name[-3:].strip(), [s], tail)) as g:
                await _offer(g.url, "/v1/chat/completions", [body] * 20, 1000)
                cpu0, t0 = cpu_seconds(g.pid), time.perf_counter()
                outs = await _offer(g.url, "/v1/chat/completions", [body] * n, 1000)
                cpu, wall = cpu_seconds(g.pid) - cpu0, time.perf_counter() - t0
            rows.append(
                {
                    "name": name,
                    "requests": n,
                    "errors": sum(1 for o in outs if o.error),
                    "cpu_ms_per_request": cpu / n * 1000,
                    "requests_per_s": n / wall,
                }
            )
            print(f"  {name}: done", file=sys.stderr)
    return rows


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.0f}"


def _print(rows: list[dict[str, Any]], base: dict[str, Any] | None) -> None:
    head = (
        f"{'contender':<16}{'TTFT p50':>9}{'p99':>8}{'p99.9':>8}{'total p50':>10}{'p99':>8}"
        f"{'p99.9':>8}{'errors':>7}{'extra':>7}{'p99 TTFT/direct':>17}"
    )
    print(head)
    for r in rows:
        ratio = "-"
        if base and r["ttft_p99"] and base["ttft_p99"]:
            ratio = f"{r['ttft_p99'] / base['ttft_p99']:.3f}"
        line = (
            f"{r['name']:<16}{_ms(r['ttft_p50']):>9}{_ms(r['ttft_p99']):>8}"
            f"{_ms(r['ttft_p999']):>8}{_ms(r['total_p50']):>10}{_ms(r['total_p99']):>8}"
            f"{_ms(r['total_p999']):>8}{r['errors']:>7}{r['extra_upstream']:>7.1%}{ratio:>17}"
        )
        if "complete_identical" in r:
            line += f"   whole and identical: {r['complete_identical']:.1%}"
        print(line)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="measured requests per contender")
    p.add_argument("--rate", type=float, default=10.0, help="requests per second (open loop)")
    p.add_argument("--tokens", type=int, default=20, help="output tokens per answer")
    p.add_argument("--only", default=",".join((*CONTENDERS, "midstream", "cost")))
    p.add_argument("--json", default=str(ROOT / "results" / "tail.json"))
    args = p.parse_args()
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = await stalls(args, tmp, only)
        if not rows and "midstream" not in only and "cost" not in only:
            return
        mid = await midstream(args, tmp) if "midstream" in only else []
        costs = await cost(args, tmp) if "cost" in only else []
    base = next((r for r in rows if r["name"] == "direct"), None)
    print(
        f"\n5% of requests stalled 3 s before the first token; {args.rate:g} requests/s, "
        f"40 ms TTFT, {args.requests} requests each (times in ms)"
    )
    _print(rows, base)
    if mid:
        print("\ntext completions, 5% of streams reset after 20 tokens (two upstreams)")
        _print(mid, None)
    if costs:
        print(
            "\nno faults: gateway CPU per streamed request of 500 tokens (open loop, all at once)"
        )
        base_cpu = costs[0]["cpu_ms_per_request"]
        for r in costs:
            print(
                f"{r['name']:<14}{r['cpu_ms_per_request']:>8.2f} ms CPU/request"
                f"{r['cpu_ms_per_request'] / base_cpu:>8.3f}x{r['errors']:>4} errors"
            )
    _write(Path(args.json), {"args": vars(args), "stalls": rows, "midstream": mid, "cost": costs})


def _write(out: Path, data: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
