"""Where one request's CPU goes: `tokenpipe serve` in front of the sim, sampled by py-spy
while 1-token requests go through it, the samples grouped by layer of the request path; and,
with `--base`, the CPU per request of this tree against another one's, interleaved.

    python benchmarks/profile_request.py                        # ~30 s: profile table
    python benchmarks/profile_request.py --base ../base/src     # + A/B CPU per request
    python benchmarks/profile_request.py --no-profile --base ../base/src --rounds 5

`--base SRC`: the `src` directory of another checkout (e.g. `git worktree add --detach
../base main`); its gateway runs with PYTHONPATH=SRC, this tree's with this tree's `src`.
CPU per request is measured as relay_cost.py does (user + system seconds of the gateway's
process over the requests of a round, 1-token answers, rounds interleaved, medians).

The profile: `py-spy record --nonblocking` on the gateway's pid (it needs ptrace rights on
it: same user and no Yama restriction, or root). Samples are charged to the innermost frame
of a layer of the path; a frame of the standard library or of a small library (enum, re,
typing, multidict's Python part) is charged to the layer that called it. Samples with no
frame below the event loop's `run` are the loop's own C code (uvloop: polling, socket reads
and writes of transports, callback dispatch). The raw stacks are kept in --raw (py-spy's
collapsed format) for a flame graph.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import statistics
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from _common import ROOT, cpu_seconds, gateway

from tokenpipe.bench import run_load
from tokenpipe.bench.procs import Service
from tokenpipe.doctor.profile import py_spy_path
from tokenpipe.serving import install_uvloop

MODEL = "sim-model"

#: Layers by file path (first match wins): (layer, pattern on "path/to/file.py").
LAYERS: tuple[tuple[str, str], ...] = (
    ("front: server span, errors", r"tokenpipe/front/http\.py"),
    ("front: drain middleware", r"tokenpipe/front/drain\.py"),
    ("front: edge (id, auth, body)", r"tokenpipe/front/edge\.py|tokenpipe/request_ids\.py"),
    ("front: answer, SSE out", r"tokenpipe/front/(answer|sse_out)\.py"),
    ("front: other", r"tokenpipe/front/"),
    ("validation (schema)", r"tokenpipe/dialects/\w+_schema\.py|pydantic|msgspec"),
    ("dialects", r"tokenpipe/dialects/"),
    ("pipeline", r"tokenpipe/pipeline\.py"),
    ("admission, limiter, deadline", r"tokenpipe/control/"),
    ("context budget", r"tokenpipe/context/"),
    ("router, tail", r"tokenpipe/router/"),
    ("relay", r"tokenpipe/relay/|tokenpipe/sse\.py"),
    ("upstream client", r"tokenpipe/upstream/|httptools"),
    ("metrics", r"tokenpipe/observe/(metrics|fasthist|genai|runtime)\.py|prometheus_client"),
    ("Server-Timing", r"tokenpipe/observe/server_timing\.py"),
    ("tracing hooks", r"tokenpipe/observe/(tracing|spans|otel)\.py|opentelemetry"),
    ("logging", r"tokenpipe/observe/logs\.py|/logging/"),
    ("usage", r"tokenpipe/usage\.py"),
    ("tokenpipe: other", r"tokenpipe/"),
    ("aiohttp web server", r"aiohttp/(web|http|streams|helpers|base_protocol|tcp_helpers)"),
    ("aiohttp: other", r"aiohttp/"),
    ("asyncio (tasks, timeouts)", r"asyncio/(?!runners)"),
)
#: Frames charged to their caller's layer (the standard library's small helpers and the like).
_PASS_THROUGH = re.compile(
    r"/(enum|re|typing|functools|abc|contextlib|copy|_weakrefset)\.py|"
    r"multidict|yarl|<frozen|orjson"
)
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
_LOOP = "event loop C code (uvloop), no Python frame"


def _layer(path: str) -> str | None:
    if _PASS_THROUGH.search(path):
        return None
    for name, pattern in LAYERS:
        if re.search(pattern, path):
            return name
    return None


def _stacks(raw: Path) -> Iterator[tuple[list[tuple[str, str]], int]]:
    """(frames outermost first as (function, file), samples) per line of py-spy's raw output."""
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = []
        for part in stack.split(";"):
            m = _FRAME.match(part)
            frames.append((m["func"], m["file"]) if m else (part, ""))
        yield frames, int(count)


def analyse(raw: Path, requests: int, rate_hz: int, top: int) -> None:
    """Prints samples by layer (own time), by function (own and cumulative), as us/request."""
    own_layer: Counter[str] = Counter()
    own_func: Counter[str] = Counter()
    cum_func: Counter[str] = Counter()
    total = 0
    for frames, n in _stacks(raw):
        total += n
        layer = None
        for _func, path in reversed(frames):
            layer = _layer(path)
            if layer is not None:
                break
        if layer is None:
            layer = _LOOP if frames and "runners" in frames[-1][1] else "other (stdlib, libs)"
        own_layer[layer] += n
        leaf_func, leaf_path = frames[-1]
        own_func[f"{leaf_func} ({_short(leaf_path)})"] += n
        for key in {f"{f} ({_short(p)})" for f, p in frames}:
            cum_func[key] += n
    us = 1e6 / rate_hz / requests  # microseconds per request of one sample
    print(
        f"\n{total} samples at {rate_hz} Hz over {requests} requests: "
        f"{total * us:.0f} us sampled per request\n"
    )
    print(f"{'layer (own time, callees in stdlib charged to it)':<52} {'us/req':>7} {'share':>6}")
    for name, n in own_layer.most_common():
        print(f"{name:<52} {n * us:7.1f} {n / total:6.1%}")
    for title, counter in (("own", own_func), ("cumulative", cum_func)):
        print(f"\ntop {top} functions by {title} time{'':<40} us/req  share")
        for name, n in counter.most_common(top):
            print(f"  {name[:84]:<84} {n * us:6.1f} {n / total:6.1%}")


def _short(path: str) -> str:
    for marker in ("site-packages/", "/src/", "/lib/python3"):
        i = path.find(marker)
        if i >= 0:
            return path[i + len(marker) :]
    return path


def _gateway(sim_url: str, src: str) -> Service:
    return gateway(sim_url, env={"PYTHONPATH": src})


async def _load(svc: Service, concurrency: int, requests: int) -> float:
    """CPU seconds of the gateway per request for `requests` 1-token requests."""
    before = cpu_seconds(svc.pid)
    result = await run_load(
        svc.url + "/v1",
        MODEL,
        concurrency=concurrency,
        requests=requests,
        max_tokens=1,
        prompt_tokens=32,
    )
    errors = sum(1 for r in result.records if not r.ok)
    if errors:
        print(f"  {errors} of {requests} requests failed", flush=True)
    return (cpu_seconds(svc.pid) - before) / requests


async def _profile(svc: Service, args: argparse.Namespace) -> None:
    raw = Path(args.raw)
    raw.parent.mkdir(parents=True, exist_ok=True)
    spy = await asyncio.create_subprocess_exec(
        py_spy_path(),
        "record",
        "--pid",
        str(svc.pid),
        "--rate",
        str(args.rate),
        "--format",
        "raw",
        "--output",
        str(raw),
        "--nonblocking",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    await asyncio.sleep(1.0)  # py-spy attaches
    cpu = await _load(svc, args.concurrency, args.profile_requests)
    spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    await asyncio.wait_for(spy.wait(), 30)
    print(f"\nprofiled: {cpu * 1e6:.0f} us of gateway CPU per request (py-spy attached)")
    analyse(raw, args.profile_requests, args.rate, args.top)


async def _bench(args: argparse.Namespace) -> None:
    here = str(ROOT / "src")
    with (
        Service("sim", "--port", "0", "--ttft-ms", "20", "--itl-ms", "5", name="sim") as sim,
        _gateway(sim.url, here) as gw,
        _gateway(sim.url, args.base) if args.base else contextlib.nullcontext() as base,
    ):
        targets = {"this tree": gw}
        if base is not None:
            targets["base"] = base
        for svc in targets.values():  # warm-up: connections, caches, estimators
            await _load(svc, args.concurrency, args.concurrency * 8)
        if args.profile:
            await _profile(gw, args)
        if base is None:
            return
        per: dict[str, list[float]] = {name: [] for name in targets}
        for r in range(args.rounds):
            order = list(targets.items())[r % 2 :] + list(targets.items())[: r % 2]
            for name, svc in order:
                per[name].append(await _load(svc, args.concurrency, args.requests) * 1e6)
        print(f"\nCPU per request, 1-token requests, {args.rounds} rounds of {args.requests}:")
        for name, rounds in per.items():
            cells = ", ".join(f"{v:.0f}" for v in rounds)
            print(f"  {name:<10} {statistics.median(rounds):6.0f} us  (rounds {cells})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--profile-requests", type=int, default=4000)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=30, help="functions listed")
    p.add_argument("--raw", default=str(ROOT / "results" / "profile_request.txt"))
    p.add_argument("--base", help="src directory of a checkout to compare against")
    p.add_argument("--analyse", metavar="RAW", help="only print the tables of a kept --raw file")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=800, help="1-token requests per A/B round")
    args = p.parse_args()
    if args.base:
        args.base = os.path.abspath(args.base)
    if args.analyse:
        analyse(Path(args.analyse), args.profile_requests, args.rate, args.top)
        return
    install_uvloop()
    asyncio.run(_bench(args))


if __name__ == "__main__":
    main()
