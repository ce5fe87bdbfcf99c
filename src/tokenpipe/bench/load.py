"""The load generator: closed-loop (N users) or open-loop (arrivals at a rate) streaming requests.

`run_load` is the programmatic entry point other benchmarks call; `run_load_processes` splits
the same load over worker processes (one per core) when one event loop is the bottleneck.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

from tokenpipe.bench import prompts as prompts_mod
from tokenpipe.bench.clients import ChatRequest, Client, make_client
from tokenpipe.bench.metrics import SLO, RequestRecord, Summary, summarise

Messages = list[dict[str, str]]
ARRIVALS = ("poisson", "gamma")


@dataclass(slots=True)
class RunResult:
    """One run: its settings, every request, and when it ran (perf_counter seconds)."""

    label: str
    protocols: tuple[str, ...]
    concurrency: int
    records: list[RequestRecord] = field(default_factory=list)
    started_at: float = 0.0
    ended_at: float = 0.0
    rate: float | None = None
    temperature: float | None = None
    #: Things the reader must know, e.g. "h2: the server answered with HTTP/1.1".
    notes: list[str] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return max(0.0, self.ended_at - self.started_at)

    def users_tokens_per_s(self) -> float | None:
        """A closed loop's throughput: the sum over users of each one's output tokens over its
        own span (first send to last end). Unlike tokens over wall time it holds no ramp and no
        wait for the last straggler: it is the rate the users sustained. None without users."""
        spans: dict[int, list[float]] = {}
        for r in self.records:
            if r.user < 0 or r.end_at is None or not r.ok:
                continue
            span = spans.setdefault(r.user, [r.sent_at, r.end_at, 0.0])
            span[0] = min(span[0], r.sent_at)
            span[1] = max(span[1], r.end_at)
            span[2] += r.output_tokens
        rates = [tokens / (end - start) for start, end, tokens in spans.values() if end > start]
        return sum(rates) if rates else None

    def summary(self, slo: SLO | None = None, protocol: str | None = None) -> Summary:
        recs = (
            self.records
            if protocol is None
            else [r for r in self.records if r.protocol == protocol]
        )
        return summarise(recs, slo=slo, wall_s=self.wall_s)

    def split_by_protocol(self) -> list[RunResult]:
        """One result per protocol of an interleaved run (same wall time: they ran together)."""
        if len(self.protocols) == 1:
            return [self]
        return [
            RunResult(
                f"{self.label} {p}".strip(),
                (p,),
                self.concurrency,
                [r for r in self.records if r.protocol == p],
                self.started_at,
                self.ended_at,
                self.rate,
                self.temperature,
                [n for n in self.notes if n.startswith(p + ":")],
            )
            for p in self.protocols
        ]


def _intervals(rate: float, arrival: str, burstiness: float, rng: random.Random) -> float:
    """Seconds to the next arrival. Gamma with shape `burstiness` and mean 1/rate: shape 1 is
    Poisson, below 1 burstier, above 1 more regular (as vLLM's benchmark defines it)."""
    if arrival == "poisson" or burstiness == 1.0:
        return rng.expovariate(rate)
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def run_load(
    url: str,
    model: str,
    *,
    concurrency: int = 1,
    requests: int | None = None,
    duration_s: float | None = None,
    rate: float | None = None,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    protocols: Sequence[str] = ("sse",),
    prompts: Sequence[Messages] | None = None,
    prompt_tokens: int = 64,
    max_tokens: int | None = 64,
    temperature: float | None = None,
    warmup: int = 0,
    headers: dict[str, str] | None = None,
    api_key: str | None = None,
    seed: int = 0,
    label: str = "",
    h2c: bool = False,
    grpc_url: str | None = None,
    timeout_s: float = 600.0,
    on_record: Callable[[RequestRecord], None] | None = None,
    ramp_s: float = 0.0,
    api: str = "chat",
) -> RunResult:
    """Send streaming requests to `url` in `api` (chat, responses or messages: apis.py) and
    record each one.

    Closed loop (default): `concurrency` users, each sends its next request when the last ends.
    They start together, or with `ramp_s`, spread evenly over that many seconds (user k at
    k * ramp_s / concurrency): a ramp of one request's duration gives steady load from the
    start instead of waves of simultaneous arrivals.
    Open loop (`rate` requests/s): arrivals on a Poisson or gamma schedule, at most
    `concurrency` in flight (an arrival beyond that waits, and its wait is not hidden: `sent_at`
    is when it went out, `RequestRecord.index` keeps the order).
    Stops after `requests` requests or `duration_s` seconds (default: 4 per user, at least 10).
    With several `protocols`, requests alternate between them (an interleaved A/B run).
    """
    if requests is None and duration_s is None:
        requests = max(10, 4 * concurrency)
    if rate is not None and rate <= 0:
        raise ValueError("rate must be > 0")
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}")
    protocols = tuple(protocols)
    n_prompts = min(requests or 1000, 1000) + warmup
    prompt_list = (
        list(prompts) if prompts else prompts_mod.synthetic(prompt_tokens, n_prompts, seed)
    )
    result = RunResult(label, protocols, concurrency, rate=rate, temperature=temperature)
    clients: dict[str, Client] = {}
    for p in protocols:
        clients[p] = make_client(
            p,
            url,
            connections=concurrency,
            api_key=api_key,
            timeout_s=timeout_s,
            h2c=h2c,
            grpc_url=grpc_url,
            api=api,
        )
    entered: list[Client] = []
    try:
        for c in clients.values():
            await c.__aenter__()
            entered.append(c)

        async def one(i: int, record: bool, lag: float = 0.0, user: int = -1) -> None:
            proto = protocols[i % len(protocols)]
            req = ChatRequest(
                model, prompts_mod.cycle(prompt_list, i), max_tokens, temperature, headers or {}
            )
            rec = RequestRecord(index=i, protocol=proto, label=label, temperature=temperature)
            rec.schedule_lag = lag
            rec.user = user
            try:
                await clients[proto].send(req, rec)
            except Exception as e:  # a broken stream fails this request, not the whole run
                rec.error = f"{type(e).__name__}: {e}"
                rec.end_at = time.perf_counter()
            if record:
                result.records.append(rec)
                if on_record is not None:
                    on_record(rec)

        if warmup:
            await _closed_loop(lambda i, _: one(i + 10**9, False), concurrency, warmup, None)
        result.started_at = time.perf_counter()
        if rate is None:
            await _closed_loop(
                lambda i, k: one(i, True, user=k), concurrency, requests, duration_s, ramp_s
            )
        else:
            await _open_loop(
                lambda i, lag: one(i, True, lag),
                concurrency,
                requests,
                duration_s,
                rate,
                arrival,
                burstiness,
                random.Random(seed),
            )
        result.ended_at = time.perf_counter()
        late = [r.schedule_lag for r in result.records if r.schedule_lag > 0.010]
        if late:
            result.notes.append(
                f"open loop: {len(late)} arrivals went out late (up to {max(late) * 1000:.0f} ms,"
                f" waiting for one of {concurrency} slots or for the client): latencies are "
                "measured from sending, so raise --concurrency if the rate should be open"
            )
    finally:
        for c in entered:
            await c.__aexit__(None, None, None)
    if "h2" in protocols:
        versions = {r.http_version for r in result.records if r.protocol == "h2" and r.status}
        if versions and versions != {"HTTP/2"}:
            result.notes.append(
                "h2: the server answered with "
                + ", ".join(sorted(versions))
                + " (no HTTP/2: over http:// httpx needs --h2c for prior-knowledge h2c, over "
                "https:// the server did not offer h2 by ALPN); h2 figures are HTTP/1.1 ones"
            )
    return result


async def _closed_loop(
    one: Callable[[int, int], Any],
    users: int,
    requests: int | None,
    duration_s: float | None,
    ramp_s: float = 0.0,
) -> None:
    counter = itertools.count()
    deadline = None if duration_s is None else time.perf_counter() + duration_s

    async def user(k: int) -> None:
        if ramp_s > 0 and k:
            await asyncio.sleep(ramp_s * k / users)  # the start schedule, not synchronisation
        while True:
            i = next(counter)
            if requests is not None and i >= requests:
                return
            if deadline is not None and time.perf_counter() >= deadline:
                return
            await one(i, k)

    # Users past the number of requests would find none to send.
    async with asyncio.TaskGroup() as tg:
        for k in range(users if requests is None else min(users, requests)):
            tg.create_task(user(k))


async def _open_loop(
    one: Callable[[int, float], Any],
    max_inflight: int,
    requests: int | None,
    duration_s: float | None,
    rate: float,
    arrival: str,
    burstiness: float,
    rng: random.Random,
) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = None if duration_s is None else start + duration_s
    # Bound: at most `max_inflight` requests at once; the next arrival waits for a free slot.
    slots = asyncio.Semaphore(max_inflight)

    async def run(i: int, lag: float) -> None:
        try:
            await one(i, lag)
        finally:
            slots.release()

    due = start
    async with asyncio.TaskGroup() as tg:
        for i in itertools.count():
            if requests is not None and i >= requests:
                break
            if deadline is not None and due >= deadline:
                break
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule, not synchronisation
            await slots.acquire()
            # Seconds behind the schedule: a full slot pool or a busy client.
            tg.create_task(run(i, max(0.0, loop.time() - due)))
            due += _intervals(rate, arrival, burstiness, rng)


def _process_worker(kwargs: dict[str, Any]) -> RunResult:
    from tokenpipe.serving import install_uvloop

    install_uvloop()
    return asyncio.run(run_load(**kwargs))


def run_load_processes(processes: int, url: str, model: str, **kwargs: Any) -> RunResult:
    """`run_load` split over `processes` worker processes (spawned; one per core is the usual
    choice): users, requests and rate are divided between them; records come back merged.
    `perf_counter` is the system's monotonic clock on Linux, so times compare across workers."""
    if processes <= 1:
        from tokenpipe.serving import install_uvloop

        install_uvloop()
        return asyncio.run(run_load(url, model, **kwargs))
    kwargs.pop("on_record", None)  # callbacks do not cross processes
    concurrency = int(kwargs.pop("concurrency", 1))
    requests = kwargs.pop("requests", None)
    rate = kwargs.pop("rate", None)
    parts = []
    for w in range(processes):
        kw = dict(kwargs, url=url, model=model, seed=int(kwargs.get("seed", 0)) + w)
        kw["concurrency"] = max(1, concurrency // processes + (w < concurrency % processes))
        if requests is not None:
            kw["requests"] = requests // processes + (w < requests % processes)
        if rate is not None:
            kw["rate"] = rate / processes
        parts.append(kw)
    with ProcessPoolExecutor(processes, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(_process_worker, parts))
    merged = RunResult(
        results[0].label,
        results[0].protocols,
        concurrency,
        rate=rate,
        temperature=results[0].temperature,
    )
    for w, r in enumerate(results):
        for rec in r.records:
            rec.index = rec.index * processes + w
        merged.records.extend(r.records)
        merged.notes.extend(n for n in r.notes if n not in merged.notes)
    merged.started_at = min(r.started_at for r in results)
    merged.ended_at = max(r.ended_at for r in results)
    merged.records.sort(key=lambda rec: rec.sent_at)
    return merged
