"""Where the added first-token time goes at concurrency 1: one request at a time on one
keep-alive connection per target (direct to the sim, through tokenpipe, through the bare aiohttp
relay and, with `--nginx`, through nginx as a streaming proxy), rounds interleaved, each
request timed by a blocking socket client (no event loop of its own in the way) to its
response head and to its first content token; beside it, the gateway's own phases (its
Server-Timing header), each server's CPU per request in this paced load, and a loopback TCP
round trip between two processes (the wake-ups a hop adds).

    python benchmarks/c1_anatomy.py                      # ~1 min; JSON in results/
    python benchmarks/c1_anatomy.py --rounds 5 --requests 200 --gap-ms 10
    python benchmarks/c1_anatomy.py --pin                # each gateway alone on CPU 0
    python benchmarks/c1_anatomy.py --nginx              # + a compiled hop (_nginx.proxy)
    python benchmarks/c1_anatomy.py --base-src ../base/src   # + tp-base: before/after
    python benchmarks/c1_anatomy.py --rounds 10 --slow-phase-ms 0.5   # what runs now and then
    python benchmarks/c1_anatomy.py --idle-poll alternate --rounds 6    # root: see below
    python benchmarks/c1_anatomy.py --redis --ratelimit-headers --ttft-ms 0   # shared limits
    python benchmarks/c1_anatomy.py --access-log --base-src ../base/src   # a log line a request

The sim sends its head and role chunk at once and the first content token `--ttft-ms`
later; tokenpipe holds its head until the role chunk is there, so its "head" is the role
chunk's arrival. CPU per request here is that of a request arriving at an idle process (a
gap of `--gap-ms` between requests, then `--ttft-ms` and 3 more tokens 20 ms apart): set
beside relay_cost.py's figure for back-to-back requests, it shows what a cold cache costs.

`--idle-poll on` runs every round with the machine's idle CPUs polling instead of halting
(_common.idle_polling: a PM QoS request on /dev/cpu_dma_latency, root only); `alternate`
every second round, so each condition's rounds sit between the other's and the table shows
both: how much of the added time is the machine's idle states (on a VM a halted vCPU exits
to the host, and the next event on it starts cold) rather than the gateway's work.

Each of the gateway's own phases (all but the wait for the upstream's head) that took
longer than `--slow-phase-ms` (0.5 by default) is listed with the time it happened. Work
that runs now and then on a request's way shows up there (a cache refreshed once a
minute, say), where the medians hide it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _nginx
from _common import (
    ACCESS_LOG_ARGS,
    CPU_DMA_LATENCY,
    RATELIMIT_HEADERS_SIM,
    ROOT,
    bare_relay,
    config_file,
    cpu_seconds,
    gateway,
    idle_polling,
    pin,
    redis_limits,
    src_dir,
    write_json,
)

sys.path.insert(0, str(ROOT))  # tests/ (the redis-server of --redis)

from tests.redis_server import RedisServer
from tokenpipe.bench.procs import Service, sim
from tokenpipe.bench.stream import server_timing

#: The gateway's phases shown, by the bench's names (Server-Timing's `queue` is limiter_wait).
PHASES = ("edge", "admission", "context", "limiter_wait", "upstream_headers")
#: The phases of the gateway's own work (the last one above holds the upstream's).
OWN_PHASES = PHASES[:-1]


def _body(tokens: int) -> bytes:
    msg = {"role": "user", "content": "hello there " * 8}
    obj = {"model": "sim-model", "stream": True, "max_tokens": tokens, "messages": [msg]}
    return json.dumps(obj).encode()


class Client:
    """One keep-alive connection, one streamed chat request at a time. A connection the
    server closed while it sat idle (tokenpipe's `server.keepalive_seconds`, 75 s by
    default, can be shorter than a long round of the other targets) is opened again before
    the next request, outside the timed part."""

    def __init__(self, url: str, body: bytes) -> None:
        self.url = url
        self.sock = self._connect()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.request = head.encode() + body

    def _connect(self) -> socket.socket:
        host, port = self.url.split("//", 1)[1].rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def one(self) -> tuple[float, float, dict[str, float]]:
        """Seconds to the response head and to the first content token; the gateway's
        Server-Timing phases (ms), when it sent them."""
        if select.select([self.sock], [], [], 0)[0]:  # readable while idle: closed by the server
            self.sock.close()
            self.sock = self._connect()
        t0 = time.perf_counter()
        self.sock.sendall(self.request)
        buf = b""
        head_at = first_at = None
        while not buf.endswith(b"0\r\n\r\n"):  # the chunked body's end
            data = self.sock.recv(65536)
            now = time.perf_counter()
            if not data:
                raise ConnectionError(f"{self.url} closed the connection")
            buf += data
            if head_at is None and b"\r\n\r\n" in buf:
                head_at = now
            if first_at is None and re.search(rb'"content":"[^"]', buf):
                first_at = now
        assert head_at is not None and first_at is not None, buf[:400]
        timing = re.search(rb"(?im)^server-timing: (.*)$", buf)
        phases: dict[str, float] = {}
        if timing:
            server_timing(timing.group(1).decode(), phases)
        return head_at - t0, first_at - t0, phases

    def close(self) -> None:
        self.sock.close()


def round_trip_us(n: int = 2000) -> float:
    """Median loopback TCP round trip (1 byte each way) to a forked echo process, 2 ms apart
    (idle between, as paced requests are): the floor of what a hop's two wake-ups cost."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    pid = os.fork()
    if pid == 0:  # the echo
        conn, _ = srv.accept()
        while data := conn.recv(64):
            conn.sendall(data)
        os._exit(0)
    s = socket.create_connection(srv.getsockname())
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        s.sendall(b"x")
        s.recv(64)
        times.append(time.perf_counter() - t)
        time.sleep(0.002)  # paced: the echo goes idle
    s.close()
    os.waitpid(pid, 0)
    srv.close()
    return statistics.median(times) * 1e6


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    limits = RATELIMIT_HEADERS_SIM if args.ratelimit_headers else ()
    upstream = sim("--ttft-ms", str(args.ttft_ms), "--itl-ms", "20", *limits)
    servers: dict[str, Service | _nginx.Nginx | None] = {"direct": None}
    nginx = contextlib.ExitStack()
    try:
        redis = nginx.enter_context(RedisServer()) if args.redis else None

        def shared(prefix: str) -> Path | None:
            """With --redis, a config whose buckets live in the one redis-server."""
            if redis is None:
                return None
            return config_file(f"c1-redis-{prefix}", redis_limits(redis.url, prefix))

        logs = ACCESS_LOG_ARGS if args.access_log else ()
        servers["tokenpipe"] = gateway(upstream.url, config=shared("tp"), serve_args=logs)
        if args.base_src:
            servers["tp-base"] = gateway(
                upstream.url, src=args.base_src, config=shared("base"), serve_args=logs
            )
        servers["bare relay"] = bare_relay(upstream.url)
        if args.nginx:
            servers["nginx"] = nginx.enter_context(_nginx.proxy(upstream.url))
        if args.pin:  # each gateway on CPU 0 (every thread); the sim and this client on 1
            for svc in servers.values():
                if svc is not None:
                    pin(svc.pid, 0)
            pin(upstream.pid, 1)
            pin(os.getpid(), 1)
        body = _body(args.tokens)
        urls = {name: (svc or upstream).url for name, svc in servers.items()}
        clients = {name: Client(url, body) for name, url in urls.items()}
        for c in clients.values():  # warm-up: connections, caches, the gateway's estimates
            for _ in range(30):
                c.one()
        conditions = {"off": ["default"], "on": ["polling"], "alternate": ["default", "polling"]}
        rows: dict[str, dict[str, dict[str, list[float]]]] = {
            c: {n: {"head": [], "first": [], "cpu_us": []} for n in servers}
            for c in conditions[args.idle_poll]
        }
        gateways = [n for n in servers if n in ("tokenpipe", "tp-base")]
        phases: dict[str, dict[str, dict[str, list[float]]]] = {
            c: {n: {p: [] for p in PHASES} for n in gateways} for c in rows
        }
        # A gateway's phase slower than --slow-phase-ms: (seconds into the run, target, phase,
        # ms), to see what runs now and then on a request's way (a cache's refresh).
        slow: list[tuple[float, str, str, float]] = []
        began = time.monotonic()
        for r in range(args.rounds):
            cond = conditions[args.idle_poll][r % len(rows)]
            with idle_polling(cond == "polling"):
                for name, client in clients.items():
                    svc = servers[name] or upstream
                    heads, firsts = [], []
                    before = cpu_seconds(svc.pid)
                    for _ in range(args.requests):
                        h, f, ph = client.one()
                        heads.append(h)
                        firsts.append(f)
                        for p in PHASES if name in gateways else ():
                            if p in ph:
                                phases[cond][name][p].append(ph[p])
                                if ph[p] > args.slow_phase_ms and p in OWN_PHASES:
                                    at = time.monotonic() - began
                                    slow.append((round(at, 1), name, p, ph[p]))
                        time.sleep(args.gap_ms / 1000)  # paced by design, not a wait for state
                    cpu = (cpu_seconds(svc.pid) - before) / args.requests * 1e6
                    rows[cond][name]["head"].append(statistics.median(heads) * 1e3)
                    rows[cond][name]["first"].append(statistics.median(firsts) * 1e3)
                    rows[cond][name]["cpu_us"].append(cpu)
            print(f"  round {r + 1}/{args.rounds} done ({cond} idle CPUs)", flush=True)
        for c in clients.values():
            c.close()
    finally:
        nginx.close()
        for server in servers.values():
            if isinstance(server, Service):
                server.stop()
        upstream.stop()
    med = {
        c: {n: {k: statistics.median(v) for k, v in cols.items()} for n, cols in by.items()}
        for c, by in rows.items()
    }
    trips = {}
    for cond in rows:
        with idle_polling(cond == "polling"):
            trips[cond] = round_trip_us()
    return {
        "rounds": rows,
        "medians": med,
        "phases_ms": {
            c: {n: {p: statistics.median(v) for p, v in ph.items() if v} for n, ph in by.items()}
            for c, by in phases.items()
        },
        "round_trip_us": trips,
        "slow_phases": slow,
        "slow_phase_ms": args.slow_phase_ms,
    }


def _print(result: dict[str, Any]) -> None:
    for cond, med in result["medians"].items():
        d = med["direct"]
        print(f"\nconcurrency 1, idle CPUs {cond}, medians of per-round medians")
        print(f"{'target':<11} {'head ms':>8} {'first ms':>9} {'added':>7} {'CPU us/req':>11}")
        for name, m in med.items():
            added = "-" if name == "direct" else f"{m['first'] - d['first']:+.2f}"
            print(f"{name:<11} {m['head']:8.2f} {m['first']:9.2f} {added:>7} {m['cpu_us']:11.0f}")
        for name, ph in result["phases_ms"][cond].items():
            print(f"{name}'s phases (Server-Timing, ms):")
            print("  " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
        trip = result["round_trip_us"][cond]
        print(f"loopback TCP round trip, two processes: {trip:.0f} us")
    slow = result["slow_phases"]
    print(f"\ngateway phases over {result['slow_phase_ms']:g} ms: {len(slow)}")
    for at, name, phase, ms in slow:
        print(f"  {at:7.1f} s into the run  {name:<10} {phase:<17} {ms:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=150, help="per target and round")
    p.add_argument("--gap-ms", type=float, default=10.0, help="idle between two requests")
    p.add_argument("--ttft-ms", type=float, default=20.0, help="the sim's first token")
    p.add_argument("--tokens", type=int, default=4, help="max_tokens of each request")
    p.add_argument(
        "--pin", action="store_true", help="the gateways on CPU 0, the sim and the client on 1"
    )
    p.add_argument(
        "--idle-poll",
        choices=["off", "on", "alternate"],
        default="off",
        help="idle CPUs poll instead of halting (root): in every round, or every second one",
    )
    p.add_argument(
        "--nginx", action="store_true", help="nginx as a proxy too: a compiled hop, no features"
    )
    p.add_argument(
        "--slow-phase-ms",
        type=float,
        default=0.5,
        help="list each gateway phase slower than this (ms), with when it happened",
    )
    p.add_argument(
        "--base-src",
        metavar="PATH",
        type=src_dir,
        help="add tp-base: tokenpipe run from this src/ directory (another checkout's)",
    )
    p.add_argument(
        "--ratelimit-headers",
        action="store_true",
        help="the sim sends OpenAI's x-ratelimit-* headers on every answer (never limiting)",
    )
    p.add_argument(
        "--redis",
        action="store_true",
        help="the gateways keep their buckets in a redis-server (limits.backend: redis)",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        help="the gateways log a line a request (serve --access-log)",
    )
    p.add_argument("--json", default=str(ROOT / "results" / "c1_anatomy.json"))
    args = p.parse_args()
    if args.nginx and _nginx.binary() is None:
        p.error("--nginx needs nginx (Debian: apt-get install nginx-light)")
    if args.idle_poll != "off" and not os.access(CPU_DMA_LATENCY, os.W_OK):
        p.error(f"--idle-poll needs write access to {CPU_DMA_LATENCY} (root)")
    result = _measure(args)
    _print(result)
    write_json(args.json, "c1_anatomy", args, **result)


if __name__ == "__main__":
    main()
