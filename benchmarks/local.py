"""Tokens/s and TTFT of the local model three ways, interleaved in one run:

1. `direct`  - llama-cpp-python called in this process (`Llama.generate`, the loop the engine
               runs), no HTTP: the ceiling;
2. `local`   - `tokenpipe local` over HTTP/SSE;
3. `gateway` - the same `tokenpipe local` through `tokenpipe serve --upstream .../v1`.

Each round runs the three in a rotated order, one request at a time (the model decodes one
sequence at a time, and the machine has two cores: anything concurrent would measure contention).
Every request has its own prompt (no prompt-cache hits) and a fixed output length (`ignore_eos`).
TTFT: request start to the first content token. tokens/s: decode rate after the first token,
(completion tokens - 1) / (last token - first token), as the client sees it.

    .venv/bin/python benchmarks/local.py [--rounds 6] [--max-tokens 128] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import procs
from tokenpipe import sse
from tokenpipe.engines.local.model import LoadedModel, ModelOptions, default_threads
from tokenpipe.engines.local.prompt import chat_segments

PATHS = ("direct", "local", "gateway")
PROMPT = "Story {tag}: write a long story about a lighthouse keeper and a storm."


def direct_trial(model: LoadedModel, prompt: str, max_tokens: int) -> dict[str, float]:
    tokens = model.encode_segments(chat_segments([{"role": "user", "content": prompt}]))
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    model.perf_reset()
    gen = model.llm.generate(tokens, temp=0.0, reset=True)
    for tok in gen:
        model.piece(tok)  # the engine detokenizes every token too
        last = time.perf_counter()
        if n == 0:
            first = last
        n += 1
        if n >= max_tokens:
            break
    gen.close()
    _, eval_ms, _, n_eval = model.perf()
    return {
        "ttft_s": first - t0,
        "tokens": n,
        "tps": (n - 1) / (last - first),
        "engine_tps": n_eval / (eval_ms / 1000),
    }


async def http_trial(
    session: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int
) -> dict[str, float]:
    body = {
        "model": "gemma-3-270m",
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": prompt}],
    }
    t0 = time.perf_counter()
    first = last = 0.0
    usage: dict[str, int] = {}
    engine_decode_ms = 0.0
    decoder = sse.SSEDecoder()
    async with session.post(base + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            for ev in decoder.feed(data):
                if ev.comment:
                    text = ev.data.decode()
                    if text.startswith("tokenpipe "):
                        fields = dict(kv.split("=") for kv in text.split()[1:])
                        engine_decode_ms = float(fields["decode_ms"])
                    continue
                if ev.data == sse.DONE:
                    continue
                chunk = orjson.loads(ev.data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk.get("choices") or ():
                    if (ch.get("delta") or {}).get("content"):
                        if not first:
                            first = now
                        last = now
    n = usage.get("completion_tokens", 0)
    out = {"ttft_s": first - t0, "tokens": n, "tps": (n - 1) / (last - first)}
    if engine_decode_ms:
        out["engine_tps"] = (n - 1) / (engine_decode_ms / 1000)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = args.threads or default_threads()
    model = LoadedModel(ModelOptions(n_ctx=args.ctx, n_threads=threads))
    samples: dict[str, list[dict[str, float]]] = {p: [] for p in PATHS}
    common = ("--ctx", str(args.ctx), "--threads", str(threads))
    with (
        procs.Service("local", "--port", "0", *common, name="bench-local", timeout=120) as local,
        procs.gateway("--upstream", local.url + "/v1") as gw,
    ):
        bases = {"local": local.url, "gateway": gw.url}
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            # Warm-up, not counted: first-touch page faults of the weights in each process.
            direct_trial(model, PROMPT.format(tag="warm"), 8)
            for name, base in bases.items():
                await http_trial(session, base, PROMPT.format(tag=f"warm-{name}"), 8)
            for r in range(args.rounds):
                order = PATHS[r % 3 :] + PATHS[: r % 3]
                for name in order:
                    prompt = PROMPT.format(tag=f"{r}-{name}")
                    if name == "direct":
                        s = direct_trial(model, prompt, args.max_tokens)
                    else:
                        s = await http_trial(session, bases[name], prompt, args.max_tokens)
                    samples[name].append(s)
                print(
                    f"round {r + 1}/{args.rounds}: "
                    + "  ".join(f"{n} {samples[n][-1]['tps']:.1f} tok/s" for n in PATHS),
                    file=sys.stderr,
                )
    summary: dict[str, Any] = {}
    base_tps = statistics.median(s["tps"] for s in samples["direct"])
    base_ttft = statistics.median(s["ttft_s"] for s in samples["direct"])
    for name in PATHS:
        tps = statistics.median(s["tps"] for s in samples[name])
        ttft = statistics.median(s["ttft_s"] for s in samples[name])
        engine = [s["engine_tps"] for s in samples[name] if "engine_tps" in s]
        summary[name] = {
            "tokens_per_s_median": round(tps, 2),
            "ttft_ms_median": round(ttft * 1000, 1),
            "tps_ratio_vs_direct": round(tps / base_tps, 4),
            "ttft_ratio_vs_direct": round(ttft / base_ttft, 3),
            "engine_decode_tokens_per_s_median": round(statistics.median(engine), 2)
            if engine
            else None,
        }
    # Share of the decode time spent inside llama.cpp's eval, per request: client tokens/s over
    # llama.cpp's own tokens/s. Load from other processes slows both alike, so this ratio shows
    # the cost of everything around the model (sampling, Python, hand-off, HTTP, gateway) even
    # on a busy machine.
    for name in PATHS:
        eff = [s["tps"] / s["engine_tps"] for s in samples[name]]
        summary[name]["efficiency_median"] = round(statistics.median(eff), 4)
    # Paired ratios: each request against the `direct` one of the same round (seconds apart),
    # so that drift in the machine's load (other processes) cancels out of the comparison.
    for name in PATHS:
        pairs = [a["tps"] / b["tps"] for a, b in zip(samples[name], samples["direct"], strict=True)]
        summary[name]["tps_paired_ratio_median"] = round(statistics.median(pairs), 4)
    # The gateway's own cost: its tokens/s against `tokenpipe local` reached directly.
    summary["gateway_vs_local_tps_ratio"] = round(
        summary["gateway"]["tokens_per_s_median"] / summary["local"]["tokens_per_s_median"], 4
    )
    return {
        "config": {
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "ctx": args.ctx,
            "threads": threads,
            "cpus": os.cpu_count(),
        },
        "summary": summary,
        "samples": samples,
    }


def table(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [
        f"{'path':<9} {'tok/s':>7} {'x direct':>9} {'paired x':>9} {'TTFT ms':>8} "
        f"{'x direct':>9} {'llama.cpp tok/s':>16} {'efficiency':>11}"
    ]
    for name in PATHS:
        r = s[name]
        lines.append(
            f"{name:<9} {r['tokens_per_s_median']:>7.1f} {r['tps_ratio_vs_direct']:>9.3f} "
            f"{r['tps_paired_ratio_median']:>9.3f} {r['ttft_ms_median']:>8.1f} "
            f"{r['ttft_ratio_vs_direct']:>9.2f} {r['engine_decode_tokens_per_s_median']:>16.2f} "
            f"{r['efficiency_median']:>11.3f}"
        )
    lines.append(f"gateway / local tokens/s (medians): {s['gateway_vs_local_tps_ratio']:.3f}")
    lines.append(
        "efficiency: client tokens/s / llama.cpp eval tokens/s, per request (1.0: no cost "
        "outside the model)"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument(
        "--threads", type=int, default=0, help="0: the engine's default (one fewer than the CPUs)"
    )
    ap.add_argument("--json", default="results/local.json")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print(f"local model: {args.rounds} rounds x {args.max_tokens} tokens, medians")
    print(table(result))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
