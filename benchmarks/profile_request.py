"""Where one request's CPU goes: `tokenpipe serve` in front of the sim, sampled by py-spy
while 1-token requests go through it, the samples grouped by layer of the request path; and,
with `--base`, the CPU per request of this tree against another one's, interleaved.

    python benchmarks/profile_request.py --pin                  # ~10 s: the profile table
    python benchmarks/profile_request.py --pin --no-profile --base ../base/src --relay
    python benchmarks/profile_request.py --pin --relay --profile-target "bare relay"
    python benchmarks/profile_request.py --analyse results/profile_request.txt --cpu-us 450

`--base SRC`: the `src` directory of another checkout (e.g. `git worktree add --detach
../base main`); its gateway runs with PYTHONPATH=SRC, this tree's with this tree's `src`.
`--relay`: the bare aiohttp relay (bare_relay.py) as well. CPU per request is measured as
relay_cost.py does (user + system seconds of the serving process over the requests of a
round, 1-token answers, rounds interleaved, medians), split into user and kernel time.

`--pin` puts the gateways on CPU 0 and everything else (this process: the client and py-spy;
the sim) on CPU 1. Use it: py-spy samples a thread that is not idle, also while it waits for a
CPU, and unpinned on 2 cores the gateway is preempted at every write that wakes the sim or
the client, which charges those waits to the write sites (unpinned, 910 us were sampled per
request against 515 us of CPU; pinned, 478 against 475).

The profile: `py-spy record --nonblocking` on the target's pid (it needs ptrace rights on
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
import statistics
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil
from _common import ROOT, bare_relay, gateway, one_token_requests, pin, py_spy_recording

from tokenpipe.bench.procs import Service
from tokenpipe.serving import install_uvloop

#: Layers by file path (first match wins): (layer, pattern on "path/to/file.py").
LAYERS: tuple[tuple[str, str], ...] = (
    ("front: HTTP/1.1 server", r"tokenpipe/front/(server|wire|app)\.py|multidict"),
    ("front: routing, errors, server span", r"tokenpipe/front/http\.py"),
    ("front: drain", r"tokenpipe/front/drain\.py"),
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
    ("bare relay's handler", r"benchmarks/bare_relay\.py"),
    ("aiohttp client", r"aiohttp/(client|connector|cookiejar|payload|tracing|resolver)"),
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


def analyse(raw: Path, requests: int, rate_hz: int, top: int, cpu_us: float | None) -> None:
    """Prints samples by layer (own time), by function (own and cumulative), as a share of
    the samples and as microseconds per request: the share of `cpu_us` (the CPU measured per
    request) when given, else of the sampled time. py-spy samples wall time while a thread is
    not idle, which includes time preempted on a busy machine: the shares, not the sampled
    microseconds, are what to read."""
    own_layer: Counter[str] = Counter()
    own_func: Counter[str] = Counter()
    cum_func: Counter[str] = Counter()
    total = 0
    for frames, n in _stacks(raw):
        total += n
        layer = None
        for _func, path in reversed(frames):
            if "asyncio/runners" in path:  # nothing of ours below: the loop's C code
                layer = _LOOP
                break
            layer = _layer(path)
            if layer is not None:
                break
        layer = layer or "other (stdlib, libs)"
        own_layer[layer] += n
        leaf_func, leaf_path = frames[-1]
        own_func[f"{leaf_func} ({_short(leaf_path)})"] += n
        for key in {f"{f} ({_short(p)})" for f, p in frames}:
            cum_func[key] += n
    us = 1e6 / rate_hz / requests  # microseconds per request of one sample
    print(
        f"\n{total} samples at {rate_hz} Hz over {requests} requests: "
        f"{total * us:.0f} us sampled per request"
        + (f", shown as shares of the {cpu_us:.0f} us of CPU measured" if cpu_us else "")
        + "\n"
    )
    if cpu_us:
        us = cpu_us / total
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


def _cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user, times.system


async def _load(svc: Service, concurrency: int, requests: int) -> tuple[float, float]:
    """(user, system) CPU seconds of the gateway per request for `requests` 1-token
    requests."""
    user, system = _cpu(svc.pid)
    result = await one_token_requests(svc, concurrency, requests)
    errors = sum(1 for r in result.records if not r.ok)
    if errors:
        print(f"  {errors} of {requests} requests failed", flush=True)
    user2, system2 = _cpu(svc.pid)
    return (user2 - user) / requests, (system2 - system) / requests


async def _profile(svc: Service, args: argparse.Namespace) -> None:
    raw = Path(args.raw)
    async with py_spy_recording(svc.pid, raw, args.rate):
        user, system = await _load(svc, args.concurrency, args.profile_requests)
    cpu = user + system
    print(
        f"\nprofiled: {cpu * 1e6:.0f} us of gateway CPU per request (py-spy attached), "
        f"{system / cpu:.0%} of it in the kernel"
    )
    analyse(raw, args.profile_requests, args.rate, args.top, cpu * 1e6)


async def _bench(args: argparse.Namespace) -> None:
    here = str(ROOT / "src")
    with (
        Service("sim", "--port", "0", "--ttft-ms", "20", "--itl-ms", "5", name="sim") as sim,
        _gateway(sim.url, here) as gw,
        _gateway(sim.url, args.base) if args.base else contextlib.nullcontext() as base,
        bare_relay(sim.url) if args.relay else contextlib.nullcontext() as relay,
    ):
        targets = {"this tree": gw}
        if base is not None:
            targets["base"] = base
        if relay is not None:
            targets["bare relay"] = relay
        if args.pin:  # the gateways on CPU 0; this process (client, py-spy) and the sim on 1
            for svc in targets.values():
                pin(svc.pid, 0)
            pin(sim.pid, 1)
            pin(os.getpid(), 1)
        for svc in targets.values():  # warm-up: connections, caches, estimators
            await _load(svc, args.concurrency, args.concurrency * 8)
        if args.profile:
            await _profile(targets[args.profile_target], args)
        if len(targets) == 1:
            return
        per: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
        for r in range(args.rounds):
            order = list(targets.items())[r % 2 :] + list(targets.items())[: r % 2]
            for name, svc in order:
                per[name].append(await _load(svc, args.concurrency, args.requests))
        print(f"\nCPU per request, 1-token requests, {args.rounds} rounds of {args.requests}:")
        print(f"  {'target':<11} {'us':>6} {'user':>6} {'system':>6}  rounds (us)")
        for name, rounds in per.items():
            total = [(u + k) * 1e6 for u, k in rounds]
            user = statistics.median(u * 1e6 for u, _ in rounds)
            system = statistics.median(k * 1e6 for _, k in rounds)
            cells = ", ".join(f"{v:.0f}" for v in total)
            print(
                f"  {name:<11} {statistics.median(total):6.0f} {user:6.0f} {system:6.0f}  {cells}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--profile-requests", type=int, default=6000)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument(
        "--profile-target",
        default="this tree",
        choices=("this tree", "base", "bare relay"),
        help="what is profiled (base and bare relay need --base and --relay)",
    )
    p.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=30, help="functions listed")
    p.add_argument("--raw", default=str(ROOT / "results" / "profile_request.txt"))
    p.add_argument("--base", help="src directory of a checkout to compare against")
    p.add_argument("--analyse", metavar="RAW", help="only print the tables of a kept --raw file")
    p.add_argument("--cpu-us", type=float, help="with --analyse: CPU us per request measured")
    p.add_argument(
        "--pin",
        action="store_true",
        help="gateways on CPU 0, the rest on CPU 1: no sample is taken while a gateway waits "
        "for a CPU (a profile of CPU, not of the machine's contention)",
    )
    p.add_argument("--relay", action="store_true", help="the bare relay in the A/B rounds too")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=800, help="1-token requests per A/B round")
    args = p.parse_args()
    if args.base:
        args.base = os.path.abspath(args.base)
    if args.analyse:
        analyse(Path(args.analyse), args.profile_requests, args.rate, args.top, args.cpu_us)
        return
    install_uvloop()
    asyncio.run(_bench(args))


if __name__ == "__main__":
    main()
