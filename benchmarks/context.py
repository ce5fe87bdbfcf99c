"""Context policies side by side: prompt tokens sent, latency and TTFT over one long conversation.

One conversation per policy grows turn by turn (a ~40-word user message, then the upstream's
real answer is appended), all through one gateway whose window for the model is --window
tokens. At each turn the policies are sent in a rotated order, one request at a time, so
machine noise falls on all of them alike. The policy is chosen per request with the header
`x-tokenpipe-context-policy`.

- `off`       the baseline: the whole history every turn (past the window a real provider
              answers 400; the sim accepts any length, the local model answers 400);
- `truncate`  the oldest turns dropped to fit;
- `summarize` the oldest turns replaced by a summary from the same upstream (cached: each turn
              summarises only what was newly dropped);
- `summarize@1.0` the same with `compress_target: 1.0`: each cut drops only what does not
              fit, so nearly every turn past the window extends the summary (summarize's
              default, 0.7, leaves room for the next turns to reuse the cut).

Prompt tokens are the upstream's own `usage.prompt_tokens` of the answers, plus, for
summarize, the prompt tokens of the summarising calls (from the upstream's stats). TTFT is
request start to the first content token; latency to the end of the stream.

    .venv/bin/python benchmarks/context.py [--turns 40] [--window 2048] [--local] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import procs
from tokenpipe import sse

#: (label, policy, compress_target): one gateway per compress_target (None: the default, 0.7
#: for summarize); summarising calls are counted around each request, so per variant.
VARIANTS: tuple[tuple[str, str, float | None], ...] = (
    ("off", "off", None),
    ("truncate", "truncate", None),
    ("summarize@1.0", "summarize", 1.0),
    ("summarize", "summarize", None),
)
POLICIES = tuple(v[0] for v in VARIANTS)
WORDS = (
    "pipe",
    "valve",
    "gauge",
    "flow",
    "river",
    "stone",
    "cloud",
    "lamp",
    "bridge",
    "harbor",
    "signal",
    "copper",
    "amber",
    "meadow",
    "lantern",
    "orbit",
    "canyon",
    "quartz",
    "willow",
    "ember",
)


def user_message(turn: int, words: int) -> str:
    picked = [WORDS[(turn * 7 + i * 3) % len(WORDS)] for i in range(words)]
    return f"Turn {turn}: remember that " + " ".join(picked) + ". What follows from it?"


async def one_turn(
    session: aiohttp.ClientSession,
    base: str,
    model: str,
    policy: str,
    messages: list[dict[str, Any]],
    max_tokens: int,
) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": messages,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] | None = None
    async with session.post(
        base + "/v1/chat/completions", json=body, headers={"x-tokenpipe-context-policy": policy}
    ) as resp:
        report = resp.headers.get("x-tokenpipe-context", "")
        if resp.status != 200:
            await resp.read()
            return {
                "status": resp.status,
                "latency": time.perf_counter() - t0,
                "ttft": None,
                "prompt_tokens": 0,
                "text": "",
                "report": report,
            }
        decoder = sse.SSEDecoder()
        async for chunk in resp.content.iter_any():
            for ev in decoder.feed(chunk):
                if ev.comment or ev.data == sse.DONE:
                    continue
                obj = orjson.loads(ev.data)
                for choice in obj.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(piece)
                if obj.get("usage"):
                    usage = obj["usage"]
    return {
        "status": 200,
        "latency": time.perf_counter() - t0,
        "ttft": ttft,
        "prompt_tokens": (usage or {}).get("prompt_tokens", 0),
        "text": "".join(text),
        "report": report,
    }


async def summary_stats(session: aiohttp.ClientSession, stats_url: str) -> tuple[int, int]:
    """(summarising calls, their prompt tokens) recorded by the upstream so far."""
    async with session.get(stats_url) as resp:
        data = await resp.json()
    recs = [r for r in data["records"] if str(r.get("id", "")).startswith("ctx-summary-")]
    return len(recs), sum(r.get("prompt_tokens", 0) for r in recs)


async def run(
    targets: dict[float | None, tuple[str, str]],
    model: str,
    turns: int,
    words: int,
    max_tokens: int,
) -> dict[str, Any]:
    """targets: compress_target -> (gateway base URL, upstream stats URL)."""
    convos: dict[str, list[dict[str, Any]]] = {
        label: [{"role": "system", "content": "You are a patient assistant. Answer briefly."}]
        for label in POLICIES
    }
    trials: dict[str, list[dict[str, Any]]] = {label: [] for label in POLICIES}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        calls = {label: [0, 0] for label in POLICIES}  # summarising calls, their tokens
        for turn in range(turns):
            k = turn % len(VARIANTS)
            for label, policy, target in VARIANTS[k:] + VARIANTS[:k]:
                msgs = convos[label]
                # Each variant's conversation has its own words, so no summary is shared.
                msgs.append({"role": "user", "content": f"[{label}] " + user_message(turn, words)})
                gw, stats = targets[target]
                before = await summary_stats(session, stats)
                r = await one_turn(session, gw, model, policy, msgs, max_tokens)
                after = await summary_stats(session, stats)
                calls[label][0] += after[0] - before[0]
                calls[label][1] += after[1] - before[1]
                trials[label].append(r)
                msgs.append({"role": "assistant", "content": r["text"] or "(no answer)"})
    out: dict[str, Any] = {}
    for label in POLICIES:
        ok = [t for t in trials[label] if t["status"] == 200]
        ttfts = [t["ttft"] for t in ok if t["ttft"] is not None]
        sent = sum(t["prompt_tokens"] for t in ok)
        n_calls, extra = calls[label]
        out[label] = {
            "turns": len(trials[label]),
            "errors": len(trials[label]) - len(ok),
            "compressed_turns": sum(1 for t in ok if t["report"]),
            "summary_calls": n_calls,
            "prompt_tokens": sent,
            "summary_prompt_tokens": extra,
            "total_prompt_tokens": sent + extra,
            "latency_median_s": statistics.median(t["latency"] for t in ok) if ok else None,
            "ttft_median_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1] if len(ttfts) >= 2 else None,
        }
    return out


def table(title: str, res: dict[str, Any]) -> str:
    base = res["off"]["total_prompt_tokens"] or 1
    lines = [
        title,
        f"{'policy':<14} {'turns':>5} {'errors':>6} {'compressed':>10} {'summaries':>9} "
        f"{'prompt tok':>10} {'+summary':>8} {'vs off':>6} {'latency p50':>11} "
        f"{'TTFT p50':>9} {'TTFT p90':>9}",
    ]

    def ms(x: float | None) -> str:
        return f"{x * 1000:.1f}ms" if x is not None else "-"

    for p in POLICIES:
        r = res[p]
        lines.append(
            f"{p:<14} {r['turns']:>5} {r['errors']:>6} {r['compressed_turns']:>10} "
            f"{r['summary_calls']:>9} {r['prompt_tokens']:>10} {r['summary_prompt_tokens']:>8} "
            f"{r['total_prompt_tokens'] / base:>6.2f} {ms(r['latency_median_s']):>11} "
            f"{ms(r['ttft_median_s']):>9} {ms(r['ttft_p90_s']):>9}"
        )
    return "\n".join(lines)


def gateway_config(
    upstream: str, model: str, window: int, summary_max: int, target: float | None
) -> dict[str, Any]:
    return {
        "upstreams": [{"name": "up", "url": upstream + "/v1"}],
        "context": {
            "margin_tokens": 16,
            "reserve_output_tokens": 64,
            "compress_target": target,
            "min_output_tokens": 16,
            "summary_max_tokens": summary_max,
            "summary_deadline_seconds": 60,
            "models": [{"name": model, "window": window}],
        },
    }


async def hop_cost(iterations: int) -> dict[str, Any]:
    """The context hop alone, in this process: microseconds per `ContextBudget.apply` on a
    40-turn conversation, per counter, for a request that fits and one that is truncated."""
    import copy

    import msgspec

    from tokenpipe.context.budget import ContextBudget
    from tokenpipe.dialects import openai_schema as schema
    from tokenpipe.router import Router
    from tokenpipe.router.policy import Policy
    from tokenpipe.settings import ContextSettings, TailSettings

    msgs = [{"role": "system", "content": "You are a patient assistant. Answer briefly."}]
    for turn in range(40):
        msgs.append({"role": "user", "content": user_message(turn, 40)})
        msgs.append({"role": "assistant", "content": user_message(turn + 1, 40)})
    counters = {"estimate": "estimate", "tiktoken": "tiktoken:cl100k_base", "gguf": "auto"}
    models: list[dict[str, Any]] = [
        {"name": f"{name}-{size}", "window": size, "tokenizer": spec}
        for name, spec in counters.items()
        for size in (100_000, 2048)
    ]
    # gguf: the local model's name picks its packaged vocabulary with tokenizer "auto".
    for m in models:
        if m["name"].startswith("gguf"):
            m["name"] = "gemma-3-270m" if m["window"] == 100_000 else "gemma-3-270m@"
            if m["name"].endswith("@"):
                m["tokenizer"] = "gguf:local"
    budget = ContextBudget(
        msgspec.convert({"models": models}, ContextSettings),
        Policy(TailSettings(), Router([])),
    )
    out: dict[str, Any] = {}
    for m in models:
        obj = {"model": m["name"], "messages": msgs, "max_tokens": 64}
        req = msgspec.convert(obj, schema.ChatRequest)
        try:
            counter = await budget.lookup.counter(m["name"])
        except Exception as e:  # the local extra is not installed
            out[m["name"]] = {"error": str(e)}
            continue
        times = []
        for _ in range(iterations):
            o = copy.copy(obj)
            t0 = time.perf_counter()
            await budget.apply(schema.ChatRequest, req, o, {})
            times.append(time.perf_counter() - t0)
        out[f"{counter.name.split(':')[0]} / {'fits' if m['window'] > 2048 else 'truncated'}"] = {
            "median_us": statistics.median(times) * 1e6,
            "first_us": times[0] * 1e6,  # counts not cached yet: every message tokenized
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--words", type=int, default=40, help="Words per user message.")
    ap.add_argument("--window", type=int, default=2048, help="Context window (tokens), sim.")
    ap.add_argument("--max-tokens", type=int, default=48, help="Answer length per turn.")
    ap.add_argument(
        "--local",
        action="store_true",
        help="Also run against the local model (slow: keep --local-turns small).",
    )
    ap.add_argument("--local-turns", type=int, default=16)
    ap.add_argument("--local-window", type=int, default=512)
    ap.add_argument("--json", default="results/context.json")
    args = ap.parse_args()
    work = Path(".cache/bench-context")
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": vars(args)}

    with contextlib.ExitStack() as stack:
        targets: dict[float | None, tuple[str, str]] = {}
        for target in dict.fromkeys(v[2] for v in VARIANTS):
            sim = stack.enter_context(
                procs.sim("--ttft-ms", "20", "--itl-ms", "2", "--model", "sim-model")
            )
            cfg = work / f"sim-{target}.yaml"
            cfg.write_text(
                yaml.safe_dump(gateway_config(sim.url, "sim-model", args.window, 64, target))
            )
            gw = stack.enter_context(procs.gateway("--config", str(cfg)))
            targets[target] = (gw.url, sim.url + "/sim/stats?last=10000")
        res = asyncio.run(run(targets, "sim-model", args.turns, args.words, args.max_tokens))
    result["sim"] = res
    print(table(f"sim: {args.turns} turns, window {args.window}, sim TTFT 20 ms, 2 ms/token", res))
    cost = asyncio.run(hop_cost(50))
    result["hop_cost"] = cost
    print("\ncontext hop alone, 81-message conversation (~5,000 words):")
    for name, r in cost.items():
        print(
            f"  {name:<24} "
            + (
                f"{r['median_us']:>9.0f} us/request (first: {r['first_us']:,.0f} us)"
                if "median_us" in r
                else r["error"]
            )
        )

    if args.local:
        with contextlib.ExitStack() as stack:
            local = stack.enter_context(
                procs.Service(
                    "local",
                    "--port",
                    "0",
                    "--ctx",
                    str(args.local_window),
                    name="bench-local",
                    timeout=120,
                )
            )
            targets = {}
            for target in dict.fromkeys(v[2] for v in VARIANTS):
                cfg = work / f"local-{target}.yaml"
                cfg.write_text(
                    yaml.safe_dump(
                        gateway_config(local.url, "gemma-3-270m", args.local_window, 24, target)
                    )
                )
                gw = stack.enter_context(procs.gateway("--config", str(cfg)))
                # One local model serves both gateways: summary calls are told apart by time.
                targets[target] = (gw.url, local.url + "/local/stats?last=1000&times=0")
            # Short turns (16 words, 8-token answers): the model prefills at a few hundred
            # tokens/s on two cores, and half the turns still overflow the window.
            res = asyncio.run(run(targets, "gemma-3-270m", args.local_turns, 16, 8))
        result["local"] = res
        print()
        print(
            table(f"local Gemma 3 270M: {args.local_turns} turns, window {args.local_window}", res)
        )

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
