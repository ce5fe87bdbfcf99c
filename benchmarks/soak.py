"""Soak: a mixed workload through one gateway for a long time, sampling the gateway's health.

    python benchmarks/soak.py                      # 30 minutes
    python benchmarks/soak.py --duration 60        # the CI-sized run (tests/test_soak_short.py)

Workload (each of --clients loops picks one kind per request): streaming (45%), non-streamed
(20%), slow reader paced by the render-rate hint (10%), a client that cancels after a few
chunks (15%), bad requests (10%). The sim injects 429s, stalls and resets into a share of
requests. Every --sample-seconds: gateway RSS, open fds, asyncio tasks, event-loop lag
(max since the last sample), requests and errors by kind. A leak is a slope: the report fits
a line (least squares) to each series after a warm-up and prints its slope per hour, then
checks that tasks, fds and in-flight requests return to their idle level once the load stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))

from tokenpipe import sse
from tokenpipe.bench.procs import Service, gateway, sim

KINDS = {"stream": 45, "unary": 20, "slow": 10, "cancel": 15, "bad": 10}
SIM_FAULTS = ["status:429@0.01", "stall:5:400@0.02", "reset:8@0.01"]


@dataclass
class Sample:
    t: float  # seconds since the start of the load
    rss_mb: float
    fds: int
    tasks: float
    lag_max_ms: float
    inflight: float
    requests: int
    errors: dict[str, int] = field(default_factory=dict)


def _metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        out[base] = out.get(base, 0.0) + float(value)
    return out


class Load:
    def __init__(self, url: str, seed: int) -> None:
        self.url = url + "/v1/chat/completions"
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.requests = 0

    def _body(self, stream: bool, tokens: int) -> dict[str, Any]:
        return {
            "model": "sim-model",
            "stream": stream,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"soak {self.rng.random()}"}],
        }

    async def one(self, s: aiohttp.ClientSession) -> None:
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        self.requests += 1
        try:
            async with asyncio.timeout(30):
                outcome = await getattr(self, "_" + kind)(s)
        except TimeoutError:
            outcome = "client-timeout"
        except aiohttp.ClientError as e:
            outcome = f"client-error:{type(e).__name__}"
        self.outcomes[f"{kind}:{outcome}"] += 1

    async def _stream(self, s: aiohttp.ClientSession, headers: dict[str, str] | None = None) -> str:
        async with s.post(self.url, json=self._body(True, 40), headers=headers) as r:
            if r.status != 200:
                await r.read()
                return str(r.status)
            dec, done, error = sse.SSEDecoder(), False, False
            async for chunk in r.content.iter_any():
                for ev in dec.feed(chunk):
                    if ev.data == sse.DONE:
                        done = True
                    elif ev.data and b'"error"' in ev.data[:20]:
                        error = True
            return "cut" if error else ("ok" if done else "no-done")

    async def _slow(self, s: aiohttp.ClientSession) -> str:
        return await self._stream(s, {"x-tokenpipe-max-tokens-per-second": "100"})

    async def _unary(self, s: aiohttp.ClientSession) -> str:
        async with s.post(self.url, json=self._body(False, 20)) as r:
            body = await r.read()
            if r.status == 200:
                orjson.loads(body)
                return "ok"
            return str(r.status)

    async def _cancel(self, s: aiohttp.ClientSession) -> str:
        async with s.post(self.url, json=self._body(True, 200)) as r:
            seen = 0
            async for _ in r.content.iter_any():
                seen += 1
                if seen >= 3:
                    break
        return "ok"  # the client went away; the gateway must free everything

    async def _bad(self, s: aiohttp.ClientSession) -> str:
        body = self.rng.choice([b"{broken", b'{"model": 1}', b"[]", b'{"messages": []}'])
        async with s.post(self.url, data=body, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            return "ok" if r.status == 400 else str(r.status)


async def _client(load: Load, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            await load.one(s)


async def _sample(g: Service, t0: float, load: Load) -> Sample:
    async with aiohttp.ClientSession() as s, s.get(g.url + "/metrics") as r:
        m = _metrics(await r.text())
    proc = psutil.Process(g.pid)
    errors = {k: v for k, v in load.outcomes.items() if not k.endswith(":ok")}
    return Sample(
        t=round(time.monotonic() - t0, 2),
        rss_mb=round(proc.memory_info().rss / 2**20, 2),
        fds=proc.num_fds(),
        tasks=m.get("tokenpipe_asyncio_tasks", 0.0),
        lag_max_ms=round(m.get("tokenpipe_event_loop_lag_max_seconds", 0.0) * 1000, 2),
        inflight=m.get("tokenpipe_inflight_requests", 0.0),
        requests=load.requests,
        errors=errors,
    )


def slope_per_hour(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (seconds), per hour."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var * 3600


async def _idle(g: Service, timeout: float = 30.0) -> Sample:
    """Waits until nothing is in flight, then samples the idle level."""
    deadline = time.monotonic() + timeout
    empty = Load(g.url, 0)
    while True:
        s = await _sample(g, 0, empty)
        if s.inflight == 0 or time.monotonic() > deadline:
            await asyncio.sleep(1.5)  # one more process sample (1 s) so tasks settle
            return await _sample(g, 0, empty)
        await asyncio.sleep(0.1)  # polling a condition with a deadline


async def soak(duration: float, clients: int, sample_every: float, seed: int) -> dict[str, Any]:
    faults = [a for f in SIM_FAULTS for a in ("--fault", f)]
    with (
        sim("--ttft-ms", "20", "--itl-ms", "5", "--seed", str(seed), *faults) as upstream,
        gateway("--upstream", upstream.url + "/v1", "--drain-seconds", "5") as g,
    ):
        before = await _idle(g)
        load = Load(g.url, seed)
        stop = asyncio.Event()
        t0 = time.monotonic()
        workers = [asyncio.create_task(_client(load, stop)) for _ in range(clients)]
        samples: list[Sample] = []
        while time.monotonic() - t0 < duration:
            await asyncio.sleep(sample_every)  # the sampling period: this is the clock of the run
            samples.append(await _sample(g, t0, load))
            last = samples[-1]
            print(
                f"t={last.t:7.1f}s rss={last.rss_mb:7.1f} MB fds={last.fds:4d} "
                f"tasks={last.tasks:5.0f} lag_max={last.lag_max_ms:6.1f} ms "
                f"inflight={last.inflight:3.0f} requests={last.requests}",
                flush=True,
            )
        stop.set()
        await asyncio.gather(*workers)
        after = await _idle(g)
        alive = g.proc.poll() is None
    warm = [s for s in samples if s.t >= 0.2 * duration] or samples
    xs = [s.t for s in warm]
    lags = sorted(s.lag_max_ms for s in samples)
    report = {
        "duration_s": duration,
        "clients": clients,
        "requests": load.requests,
        "outcomes": dict(sorted(load.outcomes.items())),
        "slopes_per_hour": {
            "rss_mb": round(slope_per_hour(xs, [s.rss_mb for s in warm]), 2),
            "fds": round(slope_per_hour(xs, [float(s.fds) for s in warm]), 2),
            "tasks": round(slope_per_hour(xs, [s.tasks for s in warm]), 2),
            "lag_max_ms": round(slope_per_hour(xs, [s.lag_max_ms for s in warm]), 2),
        },
        "lag_max_ms": {
            "median": lags[len(lags) // 2] if lags else 0,
            "max": lags[-1] if lags else 0,
        },
        "idle_before": asdict(before),
        "idle_after": asdict(after),
        "gateway_alive": alive,
        "samples": [asdict(s) for s in samples],
    }
    return report


def _table(r: dict[str, Any]) -> str:
    b, a, sl = r["idle_before"], r["idle_after"], r["slopes_per_hour"]
    rows = [
        ("series", "idle before", "idle after", "slope under load (/hour)"),
        ("RSS (MB)", f"{b['rss_mb']:.1f}", f"{a['rss_mb']:.1f}", f"{sl['rss_mb']:+.1f}"),
        ("open fds", f"{b['fds']}", f"{a['fds']}", f"{sl['fds']:+.1f}"),
        ("asyncio tasks", f"{b['tasks']:.0f}", f"{a['tasks']:.0f}", f"{sl['tasks']:+.1f}"),
        ("in flight", f"{b['inflight']:.0f}", f"{a['inflight']:.0f}", ""),
        ("loop lag max (ms)", "", "", f"{sl['lag_max_ms']:+.1f}"),
    ]
    lines = [f"{c0:<20}{c1:>14}{c2:>14}{c3:>26}" for c0, c1, c2, c3 in rows]
    lag = r["lag_max_ms"]
    lines.append(f"loop lag max per sample: median {lag['median']} ms, worst {lag['max']} ms")
    lines.append(f"{r['requests']} requests in {r['duration_s']:.0f} s, {r['clients']} clients")
    for k, v in r["outcomes"].items():
        lines.append(f"  {k:<40}{v:>8}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--duration", type=float, default=1800.0, help="seconds of load (default 30 min)"
    )
    p.add_argument("--clients", type=int, default=16, help="concurrent client loops")
    p.add_argument(
        "--sample-seconds",
        type=float,
        default=None,
        help="sampling period (default: duration/60, at least 1 s)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, default=Path("results/soak.json"))
    a = p.parse_args()
    every = a.sample_seconds or max(1.0, a.duration / 60)
    report = asyncio.run(soak(a.duration, a.clients, every, a.seed))
    print(_table(report))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
