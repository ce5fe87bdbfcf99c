"""What one request costs, counted rather than timed: Python function calls per 1-token
request (cProfile) and, with `--syscalls`, system calls per request (strace -c), for this
tree and another checkout side by side. Counts do not move with the machine's noise, so a
change of a few microseconds, which CPU time (relay_cost.py, +-10 us between rounds) cannot
resolve, shows up here as calls removed.

    python benchmarks/calls_per_request.py                          # ~40 s
    python benchmarks/calls_per_request.py --base ../base/src --syscalls
    python benchmarks/calls_per_request.py --ratelimit-headers    # answers carry x-ratelimit-*
    python benchmarks/calls_per_request.py --opcodes --base ../base/src  # ~2 min
    python benchmarks/calls_per_request.py --opcodes --whole   # non-streamed requests
    python benchmarks/calls_per_request.py --opcodes --messages 30 --model gpt-4o-mini  # a chat
    python benchmarks/calls_per_request.py --opcodes --path "responses via chat"  # a translation
    python benchmarks/calls_per_request.py --opcodes --tokens 64 --itl-ms 2  # paced tokens

Each gateway runs under `python -m cProfile` in front of one sim (TTFT 0, no gaps), twice:
once for the warm-up requests alone and once for the warm-up and `--requests` more; the
difference of the two profiles, divided by `--requests`, is the request path's count with
start-up and warm-up cancelled out. The table lists the calls per request and the functions
called most, with the other tree's count beside them. cProfile slows the gateway ~2x: its
times are not shown, only counts. `--syscalls` attaches `strace -c -f` to a third gateway run
for the `--requests` after its warm-up (strace's own slowness does not change the counts).
`--opcodes` counts the bytecode instructions the gateway executes per request, by function
(benchmarks/_opcodes.py: a trace function, started after the warm-up, for `--opcode-requests`):
a call is not a unit of cost, an instruction nearly is (~11 ns of the interpreter's loop on
this machine, perf), so this is the count that says how much Python a change removed.
JSON in results/calls_per_request.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    API_PATHS,
    BENCH_KEY,
    KEY_QUOTAS,
    RATELIMIT_HEADERS_SIM,
    RELAY,
    ROOT,
    add_request_shape,
    config_file,
    gateway_under,
    one_token_requests,
    sim_models,
    strace_counts,
    upstream_args,
    whole_answers,
    write_json,
)

from tokenpipe.bench import procs
from tokenpipe.bench.procs import Service

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


async def _load(svc: Service, requests: int, args: Any) -> None:
    """`requests` 1-token requests, streamed (or, with `--whole`, non-streamed)."""
    if requests and args.whole:
        key = BENCH_KEY if args.key_quotas else None
        api = API_PATHS[args.path][0]
        await whole_answers(svc, args.concurrency, requests, model=args.model, api=api, api_key=key)
    elif requests:
        await one_token_requests(
            svc,
            args.concurrency,
            requests,
            model=args.model,
            messages=args.messages,
            api=API_PATHS[args.path][0],
            api_key=BENCH_KEY if args.key_quotas else None,
            tokens=args.tokens,
        )


def _gateway(sim_url: str, src: str | None, prefix: list[str], args: Any, **env: str) -> Service:
    """The target under `prefix`, its upstream the sim as `--path` has it."""
    upstream = upstream_args(API_PATHS[args.path][1], sim_url)
    keys = ("--config", str(config_file("calls-keys", KEY_QUOTAS))) if args.key_quotas else ()
    return gateway_under(sim_url, src, prefix, env or None, upstream=upstream, serve_args=keys)


def _name(key: tuple[str, int, str]) -> str:
    """A function's name the same in both trees: its file inside the package or library,
    without line numbers or object addresses, which differ between checkouts."""
    path, _line, func = key
    short = path.split("site-packages/")[-1].split("src/")[-1].split("lib/python3.11/")[-1]
    name = _ADDRESS.sub("", func)
    return f"{short}:{name}" if short != "~" else name


async def _profile(sim_url: str, src: str | None, requests: int, args: Any) -> dict[str, int]:
    """Calls by function over the warm-up and `requests` more (one profile run)."""
    with tempfile.NamedTemporaryFile(suffix=".prof", delete=False) as f:
        out = f.name
    try:
        with _gateway(sim_url, src, [sys.executable, "-m", "cProfile", "-o", out], args) as gw:
            await _load(gw, args.warmup + requests, args)
        calls: dict[str, int] = {}
        for key, row in pstats.Stats(out).stats.items():  # type: ignore[attr-defined]
            name = _name(key)
            calls[name] = calls.get(name, 0) + row[1]
        return calls
    finally:
        os.unlink(out)


async def _syscalls(sim_url: str, src: str | None, args: Any) -> dict[str, float]:
    """System calls per request by name, strace -c attached after the warm-up."""
    with _gateway(sim_url, src, [sys.executable], args) as gw:
        await _load(gw, args.warmup, args)
        async with strace_counts(gw.pid) as counts:
            await _load(gw, args.requests, args)
    return _per_request(counts, args.requests)


async def _opcodes(sim_url: str, src: str | None, args: Any) -> dict[str, float]:
    """Bytecode instructions per request by function, counted after the warm-up."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "opcodes.json")
        prefix = [sys.executable, str(ROOT / "benchmarks" / "_opcodes.py")]
        with _gateway(sim_url, src, prefix, args, TOKENPIPE_OPCODES_OUT=out) as gw:
            await _load(gw, args.warmup, args)
            gw.proc.send_signal(signal.SIGUSR1)
            await _load(gw, args.opcode_requests, args)
            gw.proc.send_signal(signal.SIGUSR2)
            counts = await asyncio.to_thread(_written, Path(out))
    named: dict[str, float] = {}
    for key, n in counts.items():
        path, _, func = key.rpartition(":")
        name = _name((path, 0, func))
        named[name] = named.get(name, 0) + n / args.opcode_requests
    return named


def _written(path: Path, timeout: float = 60.0) -> dict[str, int]:
    """The JSON the gateway's signal handler writes (an atomic rename), polled for."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway wrote no opcode counts in {timeout:.0f} s")
        time.sleep(0.05)
    counts: dict[str, int] = json.loads(path.read_text())
    return counts


def _per_request(counts: dict[str, int], requests: int) -> dict[str, float]:
    return {k: n / requests for k, n in counts.items()}


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    targets = [("this tree", None)] + ([("base", args.base)] if args.base else [])
    targets += [(RELAY, RELAY)] if args.relay else []
    result: dict[str, Any] = {"targets": {}}
    per: dict[str, dict[str, float]] = {}
    ops: dict[str, dict[str, float]] = {}
    limits = RATELIMIT_HEADERS_SIM if args.ratelimit_headers else ()
    models = sim_models(args.model)
    with procs.sim("--ttft-ms", "0", "--itl-ms", str(args.itl_ms), *limits, *models) as sim:
        for name, src in targets:
            print(f"  {name}: profiling", flush=True)
            warm = await _profile(sim.url, src, 0, args)
            full = await _profile(sim.url, src, args.requests, args)
            per[name] = {
                k: (n - warm.get(k, 0)) / args.requests
                for k, n in full.items()
                if n - warm.get(k, 0) > 0
            }
            entry: dict[str, Any] = {"calls_per_request": sum(per[name].values())}
            if args.syscalls:
                print(f"  {name}: counting system calls", flush=True)
                entry["syscalls_per_request"] = await _syscalls(sim.url, src, args)
            if args.opcodes:
                print(f"  {name}: counting bytecode instructions", flush=True)
                ops[name] = await _opcodes(sim.url, src, args)
                entry["opcodes_per_request"] = sum(ops[name].values())
                entry["opcodes_by_function"] = ops[name]
            result["targets"][name] = entry
    print(f"\nPython calls per {_shape(args)} (cProfile, {args.requests} requests)")
    for name, entry in result["targets"].items():
        line = f"  {name:<10} {entry['calls_per_request']:7.1f}"
        if "syscalls_per_request" in entry:
            sc = entry["syscalls_per_request"]
            most = sorted(sc.items(), key=lambda kv: -kv[1])[:4]
            listed = ", ".join(f"{k} {v:.1f}" for k, v in most)
            line += f"   syscalls {sum(sc.values()):5.1f} ({listed})"
        print(line)
    mine = per["this tree"]
    other = per.get("base", {})
    top = sorted(mine, key=lambda k: -mine[k])[: args.top]
    print(f"\n{'function (most called)':<62} {'this':>7}" + (f" {'base':>7}" if other else ""))
    for k in top:
        print(f"{k[-62:]:<62} {mine[k]:7.1f}" + (f" {other.get(k, 0.0):7.1f}" if other else ""))
    if other:
        print(f"\n{'most changed':<62} {'this':>7} {'base':>7}")
        names = sorted(set(mine) | set(other), key=lambda k: -abs(mine.get(k, 0) - other.get(k, 0)))
        for k in names[: args.top // 2]:
            print(f"{k[-62:]:<62} {mine.get(k, 0.0):7.1f} {other.get(k, 0.0):7.1f}")
    result["top"] = [{"function": k, "this": mine[k], "base": other.get(k)} for k in top]
    if ops:
        result["top_opcodes"] = _opcode_table(ops, args)
    return result


#: Layers of the request path by file (the first prefix that matches), for the table of
#: instructions by layer; the bare relay's are aiohttp's server and client.
LAYERS = (
    ("tokenpipe/front/", "front: HTTP server, edge, answer"),
    ("tokenpipe/upstream/", "upstream client"),
    ("tokenpipe/relay/", "relay and SSE"),
    ("tokenpipe/sse.py", "relay and SSE"),
    ("tokenpipe/dialects/", "dialects"),
    ("tokenpipe/router/", "router: attempts, deadlines, hedges"),
    ("tokenpipe/control/", "admission, limiter, cost"),
    ("tokenpipe/pipeline.py", "pipeline"),
    ("tokenpipe/observe/", "metrics, timing, traces"),
    ("tokenpipe/context/", "context budget"),
    ("tokenpipe/", "tokenpipe: other"),
    ("aiohttp/web", "aiohttp server"),
    ("aiohttp/client", "aiohttp client"),
    ("aiohttp/connector", "aiohttp client"),
    ("aiohttp/", "aiohttp: streams, writer, helpers"),
    ("asyncio/", "asyncio"),
)


def _shape(args: Any) -> str:
    """The measured request, as the tables name it."""
    if args.tokens == 1:
        return "1-token request"
    return f"{args.tokens}-token request, {args.itl_ms:g} ms apart"


def _layer(function: str) -> str:
    for prefix, layer in LAYERS:
        if function.startswith(prefix):
            return layer
    return "other (libraries, stdlib)"


def _opcode_table(ops: dict[str, dict[str, float]], args: Any) -> list[dict[str, Any]]:
    """Prints instructions per request (total, by layer, the functions with most, the most
    changed)."""
    print(f"\nBytecode instructions per {_shape(args)} ({args.opcode_requests} requests)")
    names = list(ops)
    by_layer: dict[str, dict[str, float]] = {n: {} for n in names}
    for n in names:
        for function, count in ops[n].items():
            layer = _layer(function)
            by_layer[n][layer] = by_layer[n].get(layer, 0.0) + count
    every = {la for n in names for la in by_layer[n]}
    layers = sorted(every, key=lambda la: -max(by_layer[n].get(la, 0.0) for n in names))
    print(f"{'layer':<40}" + "".join(f"{n[:12]:>13}" for n in names))
    for la in layers:
        print(f"{la:<40}" + "".join(f"{by_layer[n].get(la, 0.0):13.0f}" for n in names))
    print(f"{'total':<40}" + "".join(f"{sum(ops[n].values()):13.0f}" for n in names))
    mine, other = ops["this tree"], ops.get("base", {})
    top = sorted(mine, key=lambda k: -mine[k])[: args.top]
    head = f"\n{'function (most instructions)':<62} {'this':>7}"
    print(head + (f" {'base':>7}" if other else ""))
    for k in top:
        print(f"{k[-62:]:<62} {mine[k]:7.0f}" + (f" {other.get(k, 0.0):7.0f}" if other else ""))
    if other:
        print(f"\n{'most changed':<62} {'this':>7} {'base':>7}")
        names = sorted(set(mine) | set(other), key=lambda k: -abs(mine.get(k, 0) - other.get(k, 0)))
        for k in names[: args.top]:
            print(f"{k[-62:]:<62} {mine.get(k, 0.0):7.0f} {other.get(k, 0.0):7.0f}")
    return [{"function": k, "this": mine[k], "base": other.get(k)} for k in top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=3000, help="measured 1-token requests")
    p.add_argument("--warmup", type=int, default=200, help="requests before the measured ones")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--top", type=int, default=20, help="functions listed")
    p.add_argument("--base", help="src/ directory of another checkout, counted beside this one")
    p.add_argument("--syscalls", action="store_true", help="count system calls too (strace)")
    p.add_argument(
        "--opcodes", action="store_true", help="count bytecode instructions per request too"
    )
    p.add_argument("--opcode-requests", type=int, default=500, help="requests counted (slow)")
    p.add_argument("--relay", action="store_true", help="count the bare aiohttp relay too")
    p.add_argument("--whole", action="store_true", help="non-streamed requests (stream false)")
    p.add_argument(
        "--tokens",
        type=int,
        default=1,
        help="tokens a request asks for (a run of 1 and one of N: a token is their difference"
        " over N - 1)",
    )
    p.add_argument("--itl-ms", type=float, default=0.0, help="the sim's gap between tokens (ms)")
    add_request_shape(p)
    p.add_argument("--json", default=str(ROOT / "results" / "calls_per_request.json"))
    args = p.parse_args()
    if args.base:
        args.base = str(Path(args.base).resolve())
    if args.syscalls and shutil.which("strace") is None:
        p.error("--syscalls needs strace on PATH")
    result = asyncio.run(_bench(args))
    write_json(args.json, "calls_per_request", args, **result)


if __name__ == "__main__":
    main()
