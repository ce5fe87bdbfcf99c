"""A burst of streams starting together: what the gateway adds to their first token against
the sim directly, and how long they waited for the upstream's concurrency limit (a cold AIMD
limit starts at `limits.initial_concurrency`, 32).

    python benchmarks/burst.py                       # 1,000 streams, 10 tokens/s, 30 tokens
    python benchmarks/burst.py --base ../base/src    # + a gateway of another checkout
    python benchmarks/burst.py --relay               # + the bare aiohttp relay (the floor)
    python benchmarks/burst.py --pin --relay         # each hop a core of its own
    python benchmarks/burst.py --relay --nginx       # + nginx as the proxy: a compiled hop
    python benchmarks/burst.py --sim-max-active 200  # a sim with 200 slots, refusing past them
    python benchmarks/burst.py --sim-rpm 15000       # a sim with a quota: 500 at once, 250/s
    python benchmarks/burst.py --workers 2           # serve --workers 2 (both gateways)
    python benchmarks/burst.py --redis --base ../base/src   # limits shared through Redis
    python benchmarks/burst.py --upstream-host localhost   # the sim by name: DNS per connect
    python benchmarks/burst.py --rounds 1 --profile results/burst_profile.txt

Each gateway is started fresh for its burst (a cold limit, as after a deploy), one target
after the other against the same sim, their order turned by one place each round; `--rounds`
bursts per target, medians of the rounds.
`limiter wait` is the gateway's own `tokenpipe_limiter_wait_seconds`: its sum over the
burst's requests and the share of them that waited at all (not shown with `--workers` N > 1:
each worker keeps its own, and /metrics is answered by one of them). Below the table: the
garbage collector's pauses over the burst (`tokenpipe_gc_pause_seconds`, not shown with
`--workers` N > 1 either).

`--relay`: the bare aiohttp relay (benchmarks/bare_relay.py: bytes forwarded, no parsing, no
limit, no metrics) as one more target, started fresh for its burst like the gateways: what any
Python hop adds to a burst on this machine. It is one process whatever `--workers` says, and
has no /metrics, so no limiter wait or GC pauses of its own are shown. `--nginx`: nginx as a
streaming reverse proxy (benchmarks/_nginx.py, one process), the same way: what a compiled
hop with no features adds to a burst on this machine.

`--pin`: the gateway (every process and thread of it, or the relay) alone on CPU 0, the sim and
the client (this process) on CPU 1, direct included. Unpinned, the three share this machine's
2 cores, so whatever CPU the gateway spends per request is taken from the sim and the client
as well, and a burst's added TTFT is mostly that contention. Pinned, the sim and the client
are slower (one core between them, the direct row says by how much) and the added TTFT is the
gateway's own queue and hop: what a gateway on a core of its own adds.

The gateway's memory per open stream: the summed RSS of its processes (with `--workers N`, the
parent holding the port, multiprocessing's resource tracker and the N workers: psutil's
children) sampled every 50 ms during the burst, (peak - RSS just before it) / streams, in KiB;
its CPU per stream is the same processes' user + system time over the burst. The gateway is
cold when the burst starts, so what its first requests load (lazy imports, caches) is counted
in both figures.

`--profile RAW`: after the rounds, one more burst through a fresh gateway of this tree with
py-spy sampling it (`record --nonblocking`, 1,000 Hz; it needs ptrace rights on the gateway),
the raw stacks in RAW, and where the gateway's CPU per stream went, by layer and function
(profile_request.py's analysis).
JSON in results/burst.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _nginx
from _common import (
    ROOT,
    RssPeak,
    bare_relay,
    config_file,
    cpu_seconds,
    fmt,
    gateway,
    pin,
    py_spy_recording,
    redis_limits,
    src_dir,
    write_json,
)
from profile_request import analyse
from yarl import URL

sys.path.insert(0, str(ROOT))  # tests/ (the redis-server of --redis)

from tests.redis_server import RedisServer
from tokenpipe.bench import run_load
from tokenpipe.bench.procs import Service
from tokenpipe.serving import install_uvloop

MODEL = "sim-model"
#: RSS sampling period during a burst.
SAMPLE_S = 0.05
#: py-spy's samples per second with --profile.
PROFILE_HZ = 1000


@dataclass
class Round:
    """One burst of one target (the gateway's figures None for direct)."""

    ttft_p50_ms: float
    ttft_p99_ms: float
    failed: int
    tokens_per_s: float
    #: tokenpipe_limiter_wait_seconds: (sum of seconds, requests, requests that waited 0 s);
    #: None with --workers N > 1 (each worker has its own /metrics, one of them answers).
    limiter_wait: tuple[float, float, float] | None
    rss_before_mib: float | None
    rss_peak_mib: float | None
    rss_kib_per_stream: float | None
    cpu_ms_per_stream: float | None
    processes: int | None
    #: The garbage collector's pauses over the burst (tokenpipe_gc_pause_seconds, all
    #: generations), ms; None with --workers N > 1 or a gateway without the metric.
    gc_pause_ms: float | None = None


def _metrics(url: str) -> str:
    return str(urllib.request.urlopen(url + "/metrics", timeout=10).read().decode())


def _gc_pause_ms(text: str) -> float | None:
    """tokenpipe_gc_pause_seconds' sum over its generations, in ms (None: no such metric)."""
    sums = [
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("tokenpipe_gc_pause_seconds_sum")
    ]
    return sum(sums) * 1e3 if sums else None


def _limiter_wait(text: str) -> tuple[float, float, float]:
    """(sum of seconds, requests, requests that waited 0 s) of tokenpipe_limiter_wait_seconds."""
    total = count = zero = 0.0
    for line in text.splitlines():
        if not line.startswith("tokenpipe_limiter_wait_seconds"):
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("tokenpipe_limiter_wait_seconds_sum"):
            total += float(value)
        elif name.startswith("tokenpipe_limiter_wait_seconds_count"):
            count += float(value)
        elif 'le="0.001"' in name:  # the first bucket edge: no wait to speak of
            zero += float(value)
    return total, count, zero


#: Numbers each burst's keys in the redis-server of `--redis`.
_BURSTS = itertools.count()

#: The target that is the bare relay in a run's targets (no src: it is benchmarks/').
RELAY = "relay"
#: The target that is nginx as a streaming proxy (_nginx.proxy): a compiled hop.
NGINX = "nginx"


@contextlib.contextmanager
def _target(
    name: str, sim: Service, src: str | None, args: argparse.Namespace
) -> Iterator[tuple[str, Service | _nginx.Nginx | None]]:
    if name == "direct":
        yield sim.url, None
        return
    if name == NGINX:
        with _nginx.proxy(sim.url) as proxy:
            if args.pin:
                pin(proxy.pid, 0)
            yield proxy.url, proxy
        return
    if name == RELAY:
        with bare_relay(sim.url) as relay:
            if args.pin:
                pin(relay.pid, 0)
            yield relay.url, relay
        return
    # --upstream-host: the gateway reaches the sim by that name (a lookup per connection
    # unless cached), not by its IP literal.
    upstream = str(URL(sim.url).with_host(args.upstream_host)) if args.upstream_host else sim.url
    config = None
    if args.redis_url:  # its buckets in the redis-server, under keys of this burst alone
        config = config_file("burst-redis", redis_limits(args.redis_url, f"burst{next(_BURSTS)}"))
    with gateway(upstream, src=src, workers=args.workers, config=config) as gw:
        if args.pin:
            pin(gw.pid, 0)
        yield gw.url, gw


async def _burst(url: str, args: argparse.Namespace) -> tuple[list[float], int, float, float]:
    """TTFTs (ms) of one burst, its failed requests, its output tokens/s, and its wall time."""
    result = await run_load(
        url + "/v1",
        MODEL,
        concurrency=args.streams,
        requests=args.streams,
        max_tokens=args.tokens,
        prompt_tokens=32,
        timeout_s=120,
    )
    ttfts = [r.ttft * 1e3 for r in result.records if r.ok and r.ttft is not None]
    failed = sum(1 for r in result.records if not r.ok)
    tokens = sum(r.output_tokens for r in result.records if r.ok)
    return ttfts, failed, tokens / max(result.wall_s, 1e-9), result.wall_s


async def _round(
    url: str, gw: Service | _nginx.Nginx | None, args: argparse.Namespace, metrics: bool = True
) -> Round:
    """One burst against `url`, with the gateway's memory and CPU when there is one (`gw`),
    and its limiter waits and GC pauses when it has a /metrics of its own (`metrics`)."""
    if gw is None:
        ttfts, failed, tps, _ = await _burst(url, args)
        q = statistics.quantiles(ttfts, n=100)
        return Round(q[49], q[98], failed, tps, (0.0, 0.0, 0.0), None, None, None, None, None)
    one = metrics and args.workers == 1  # else each worker has its own /metrics
    gc0 = _gc_pause_ms(_metrics(url)) if one else None
    cpu0 = cpu_seconds(gw.pid)
    with RssPeak(gw.pid, SAMPLE_S) as rss:
        ttfts, failed, tps, _ = await _burst(url, args)
    cpu_s = cpu_seconds(gw.pid) - cpu0
    text = _metrics(url) if one else ""
    gc1 = _gc_pause_ms(text)
    q = statistics.quantiles(ttfts, n=100)
    return Round(
        q[49],
        q[98],
        failed,
        tps,
        _limiter_wait(text) if one else None,
        rss.before / 2**20,
        rss.peak / 2**20,
        (rss.peak - rss.before) / 1024 / args.streams,
        cpu_s * 1e3 / args.streams,
        len(rss.procs),
        gc1 - gc0 if gc0 is not None and gc1 is not None else None,
    )


def _median(xs: list[float | None]) -> float | None:
    values = [x for x in xs if x is not None]
    return statistics.median(values) if values else None


def _summary(name: str, rs: list[Round], direct: list[Round]) -> dict[str, Any]:
    """A target's medians over its rounds, and the rounds themselves."""
    p50 = statistics.median(x.ttft_p50_ms for x in rs)
    tps = statistics.median(x.tokens_per_s for x in rs)
    direct_tps = statistics.median(x.tokens_per_s for x in direct)
    waits = [x.limiter_wait for x in rs]
    return {
        "target": name,
        "ttft_p50_ms": p50,
        "ttft_p99_ms": statistics.median(x.ttft_p99_ms for x in rs),
        "added_ttft_p50_ms": p50 - statistics.median(x.ttft_p50_ms for x in direct),
        "requests_failed": sum(x.failed for x in rs),
        "tokens_per_s": tps,
        "tokens_per_s_vs_direct": tps / (direct_tps or 1.0),
        "limiter_wait_s": _median([w[0] if w else None for w in waits]),
        "limiter_waited_share": _median(
            [((w[1] - w[2]) / w[1] if w[1] else 0.0) if w else None for w in waits]
        ),
        "rss_before_mib": _median([x.rss_before_mib for x in rs]),
        "rss_peak_mib": _median([x.rss_peak_mib for x in rs]),
        "rss_kib_per_stream": _median([x.rss_kib_per_stream for x in rs]),
        "cpu_ms_per_stream": _median([x.cpu_ms_per_stream for x in rs]),
        "gc_pause_ms": _median([x.gc_pause_ms for x in rs]),
        "rounds": [asdict(x) for x in rs],
    }


def _share(v: float | None) -> str:
    return f"{'-':>6}" if v is None else f"{v:6.0%}"


def _print(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{args.streams} streams at once, {args.tokens} tokens at {args.tokens_per_second:g}/s, "
        f"TTFT {args.ttft_ms:g} ms at the sim"
    )
    if args.pin:
        print("pinned: each gateway alone on CPU 0; the sim and the client on CPU 1")
    if args.workers > 1:
        print(f"gateways with --workers {args.workers}; wait s, waited: not shown (per worker)")
    print(
        f"medians of {args.rounds} round(s); TTFT in ms; KiB and CPU ms per stream: the gateway's"
    )
    print(
        f"{'target':<10} {'p50 ms':>6} {'p99 ms':>6} {'+p50':>7} {'errors':>6} "
        f"{'x tok/s':>7} {'wait s':>6} {'waited':>6} {'KiB/strm':>8} {'CPU/strm':>8}"
    )
    for r in rows:
        print(
            f"{r['target']:<10} {r['ttft_p50_ms']:6.0f} {r['ttft_p99_ms']:6.0f} "
            f"{r['added_ttft_p50_ms']:+7.1f} {r['requests_failed']:6d} "
            f"{r['tokens_per_s_vs_direct']:7.2f} {fmt(r['limiter_wait_s'], 6, 1)} "
            f"{_share(r['limiter_waited_share'])} {fmt(r['rss_kib_per_stream'], 8, 1)} "
            f"{fmt(r['cpu_ms_per_stream'], 8, 3)}"
        )
    for r in rows:
        if r["rss_before_mib"] is not None:
            n = r["rounds"][0]["processes"]
            print(
                f"{r['target']}: RSS {r['rss_before_mib']:.1f} MiB before the burst, "
                f"{r['rss_peak_mib']:.1f} MiB at its peak ({n} process{'es' if n > 1 else ''})"
            )
        if r.get("gc_pause_ms") is not None:
            print(f"{r['target']}: the garbage collector paused it {r['gc_pause_ms']:.0f} ms")


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    itl = 1000.0 / args.tokens_per_second
    sim_args: tuple[str, ...] = ("--ttft-ms", str(args.ttft_ms), "--itl-ms", f"{itl:g}")
    if args.sim_max_active:
        sim_args += ("--max-active", str(args.sim_max_active))
    if args.sim_rpm:  # the bucket refills between bursts (each target's burst ~5 s apart)
        sim_args += ("--rpm", f"{args.sim_rpm:g}", "--bucket-seconds", "2")
    refused: dict[str, int] = {}
    targets: dict[str, str | None] = {"direct": None, "tokenpipe": str(ROOT / "src")}
    if args.base:
        targets["base"] = args.base
    if args.relay:
        targets[RELAY] = None
    if args.nginx:
        targets[NGINX] = None
    rounds: dict[str, list[Round]] = {}
    with contextlib.ExitStack() as stack:
        args.redis_url = stack.enter_context(RedisServer()).url if args.redis else None
        sim = stack.enter_context(Service("sim", "--port", "0", *sim_args, name="sim"))
        if args.pin:  # the gateways on CPU 0 (_target); the sim and this process on 1
            pin(sim.pid, 1)
            pin(os.getpid(), 1)
        for r in range(args.rounds):
            # Each target takes each place in a round's order in turn: the one right after
            # another's burst ran slower (2026-12-07, pinned: this tree and the base each
            # +100-200 ms when placed after direct, in two runs with the order fixed).
            order = list(targets.items())
            order = order[r % len(order) :] + order[: r % len(order)]
            for name, src in order:
                before = _sim_errors(sim)
                with _target(name, sim, src, args) as (url, gw):
                    x = await _round(url, gw, args, metrics=name not in (RELAY, NGINX))
                refused[name] = refused.get(name, 0) + _sim_errors(sim) - before
                rounds.setdefault(name, []).append(x)
                kib = x.rss_kib_per_stream
                mem = f", {kib:.1f} KiB/stream" if kib is not None else ""
                print(
                    f"  round {r + 1} {name}: p50 {x.ttft_p50_ms:.0f} ms, "
                    f"p99 {x.ttft_p99_ms:.0f} ms{mem}",
                    flush=True,
                )
        rows = [_summary(name, rs, rounds["direct"]) for name, rs in rounds.items()]
        for row in rows:
            row["upstream_refused"] = refused.get(row["target"], 0)
        _print(args, rows)
        if args.sim_max_active or args.sim_rpm:
            for row in rows:
                print(f"{row['target']}: the sim refused {row['upstream_refused']} requests")
        if args.profile:
            await _profile(sim, args)
    return {"rows": rows}


def _sim_errors(sim: Service) -> int:
    """Requests the sim has refused or failed so far (its /sim/stats outcomes)."""
    with urllib.request.urlopen(sim.url + "/sim/stats", timeout=10) as r:
        return int(json.loads(r.read())["outcomes"].get("error", 0))


async def _profile(sim: Service, args: argparse.Namespace) -> None:
    """One burst through a fresh gateway of this tree, sampled by py-spy; its analysis."""
    raw = Path(args.profile)
    with _target("tokenpipe", sim, str(ROOT / "src"), args) as (url, gw):
        assert isinstance(gw, Service)
        async with py_spy_recording(gw.pid, raw, PROFILE_HZ):
            cpu0 = cpu_seconds(gw.pid)
            await _burst(url, args)
            cpu_us = (cpu_seconds(gw.pid) - cpu0) * 1e6 / args.streams
    print(f"\nprofiled burst: {cpu_us:.0f} us of gateway CPU per stream (py-spy attached)")
    analyse(raw, args.streams, PROFILE_HZ, 25, cpu_us)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=30)
    p.add_argument("--tokens-per-second", type=float, default=10.0)
    p.add_argument("--ttft-ms", type=float, default=100.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--base", type=src_dir, help="src directory of a checkout to compare against")
    p.add_argument(
        "--workers", type=int, default=1, help="gateway processes (tokenpipe serve --workers N)"
    )
    p.add_argument(
        "--redis",
        action="store_true",
        help="the gateways keep their buckets in a redis-server (limits.backend: redis),"
        " fresh keys each burst",
    )
    p.add_argument(
        "--upstream-host",
        help="the name the gateways reach the sim by (e.g. localhost), instead of 127.0.0.1",
    )
    p.add_argument(
        "--pin", action="store_true", help="the gateway on CPU 0, the sim and the client on 1"
    )
    p.add_argument("--relay", action="store_true", help="+ the bare aiohttp relay as a target")
    p.add_argument(
        "--nginx", action="store_true", help="+ nginx as a streaming proxy: a compiled hop"
    )
    p.add_argument(
        "--sim-max-active",
        type=int,
        metavar="N",
        help="the sim refuses with 503 past N requests answering (an overloaded upstream)",
    )
    p.add_argument(
        "--sim-rpm",
        type=float,
        metavar="R",
        help="the sim enforces R requests a minute, 2 s deep (429 with x-ratelimit-* past it)",
    )
    p.add_argument("--profile", metavar="RAW", help="+ one burst under py-spy, stacks in RAW")
    p.add_argument("--json", default=str(ROOT / "results" / "burst.json"))
    args = p.parse_args()
    if args.workers < 1:
        p.error("--workers: 1 or more")
    if args.nginx and _nginx.binary() is None:
        p.error("--nginx needs nginx (Debian: apt-get install nginx-light)")
    install_uvloop()
    result = asyncio.run(_bench(args))
    write_json(args.json, "burst", args, **result)


if __name__ == "__main__":
    main()
