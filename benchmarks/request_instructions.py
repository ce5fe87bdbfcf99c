"""What one request and one token cost in machine instructions, the interpreter and every C
library included, counted by valgrind's callgrind: for this tree, another checkout and the
bare aiohttp relay, each in front of one sim.

CPU time on this shared 2-core VM moves by 15% between runs and days (relay_cost.py,
request_cpu.py): a change of 2% cannot be seen in it. Bytecode counts
(`calls_per_request.py --opcodes`) are exact but blind to C: a header decode, an exception
raised and cleared inside a C call, an allocation. This count sees both, and is the same
from one run to the next within ~0.1% (the rounds' range says so), whatever else the
machine does. It does not see the kernel (system calls: `calls_per_request.py --syscalls`).

    python benchmarks/request_instructions.py                      # ~2 min
    python benchmarks/request_instructions.py --base-src ../base/src --tokens 64
    python benchmarks/request_instructions.py --top 30             # the costliest functions
    python benchmarks/request_instructions.py --prompt 16000       # ~70 KB prompts
    python benchmarks/request_instructions.py --tokens 64 --itl-ms 2   # paced tokens
    python benchmarks/request_instructions.py --path "messages via chat"  # a translation
    python benchmarks/request_instructions.py --ratelimit-headers  # answers carry x-ratelimit-*
    python benchmarks/request_instructions.py --messages 30 --model gpt-4o-mini  # a chat's history
    python benchmarks/request_instructions.py --access-log --no-relay   # a log line a request
    python benchmarks/request_instructions.py --otlp metrics --no-relay   # GenAI metrics on
    python benchmarks/request_instructions.py --whole         # non-streamed answers
    python benchmarks/request_instructions.py --tls           # an https upstream (nginx, TLS)
    python benchmarks/request_instructions.py --redis         # limits shared through Redis
    python benchmarks/request_instructions.py --key-quotas    # auth on, per-key quotas
    python benchmarks/request_instructions.py --keep /tmp/cg --no-relay   # then, on a dump:
    callgrind_annotate --tree=caller "/tmp/cg/this tree/cg.out.2"  # who calls what

Each target runs under `valgrind --tool=callgrind --instr-atstart=no` (near native speed
until counting starts). After `--warmup` requests at full speed, counting starts
(`callgrind_control -i on`), `--warmup` more requests run counted and are dropped (a dump
zeroes the counters), then each round's requests run and a dump reads their count.
A dump is taken when the process next wakes, so each is triggered by one extra 1-token
chat request (a 32-token prompt), which then counts in the next round: a round is its
requests plus one (with another `--path`, that one request is of another path: a few
hundredths of a percent). With `--tokens T`, each round also sends `--long-requests` of T
tokens: a token's cost is what a long request costs past a 1-token one, over its T - 1 more
tokens.

The table's instructions are user-space instructions executed (callgrind's Ir), not time:
the interpreter's own loop runs ~3 a cycle here, memory-bound code fewer. `--top` lists the
functions with the most instructions of their own (callgrind_annotate), this tree beside
the other targets. JSON in results/request_instructions.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

from _common import (
    ACCESS_LOG_ARGS,
    API_PATHS,
    BENCH_KEY,
    KEY_QUOTAS,
    RATELIMIT_HEADERS_SIM,
    READING_RELAY,
    RELAY,
    add_request_shape,
    config_file,
    gateway_under,
    one_token_requests,
    redis_limits,
    sim_models,
    upstream_args,
    whole_answers,
    write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (--otlp's receiver)

import _nginx

from tests.otlp_receiver import Receiver
from tests.redis_server import RedisServer
from tokenpipe.bench import procs, run_load
from tokenpipe.bench.procs import Service

#: What each share of the instructions is, by the file or library that runs it (the first
#: match of the function's source file or object; the interpreter's by its source file).
KINDS = (
    ("Python/ceval.c", "interpreter: the bytecode loop"),
    ("pycore_frame.h", "interpreter: the bytecode loop"),
    ("Python/frame.c", "interpreter: the bytecode loop"),
    ("obmalloc.c", "interpreter: memory"),
    ("Objects/", "interpreter: objects (dict, str, int, ...)"),
    ("Include/", "interpreter: objects (dict, str, int, ...)"),
    ("_asyncio.", "asyncio (C)"),
    ("uvloop", "uvloop and libuv"),
    ("msgspec", "msgspec, orjson"),
    ("orjson", "msgspec, orjson"),
    ("httptools", "httptools"),
    ("aiohttp", "aiohttp, multidict, yarl (C)"),
    ("multidict", "aiohttp, multidict, yarl (C)"),
    ("yarl", "aiohttp, multidict, yarl (C)"),
    ("propcache", "aiohttp, multidict, yarl (C)"),
    ("frozenlist", "aiohttp, multidict, yarl (C)"),
    ("libc.so", "libc (memcpy, malloc, ...)"),
    ("Python-3", "interpreter: the rest"),
    ("libpython", "interpreter: the rest"),
)

_ANNOTATED = re.compile(r"^\s*([\d,]+) \([ \d.]+%\)\s+(\S.*?)(?: \[(.+)\])?$")


def _kind(function: str, obj: str) -> str:
    for needle, kind in KINDS:
        if needle in function or needle in obj:
            return kind
    return "other"


def _totals(path: Path) -> int:
    """The instructions a dump file counted (its `totals:` line)."""
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"{path}: no totals line")


def _by_function(path: Path) -> dict[str, tuple[int, str]]:
    """Each function's own instructions in a dump, with its object file (callgrind_annotate
    with no threshold)."""
    out = subprocess.run(
        ["callgrind_annotate", "--threshold=100", "--inclusive=no", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        m = _ANNOTATED.match(line)
        if m and m.group(2) != "PROGRAM TOTALS":
            name = m.group(2).split("/Python-3.11.7/")[-1].split("site-packages/")[-1]
            n = int(m.group(1).replace(",", ""))
            prev = found.get(name, (0, ""))
            found[name] = (prev[0] + n, m.group(3) or prev[1])
    return found


class Counted:
    """One target under callgrind, with its dumps numbered from 1 in `folder`."""

    def __init__(self, svc: Service, folder: Path, api_key: str | None = None) -> None:
        self.svc = svc
        self.folder = folder
        self.api_key = api_key  # (the waking request's, with --key-quotas)
        self.dumps = 0

    async def _control(self, *args: str) -> None:
        """A callgrind_control command, acted on when the process next wakes: one request
        wakes it (bounded: 120 s for valgrind to answer)."""
        cmd = await asyncio.create_subprocess_exec(
            "callgrind_control",
            *args,
            str(self.svc.pid),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        await one_token_requests(self.svc, 1, 1, api_key=self.api_key)
        if await asyncio.wait_for(cmd.wait(), 120) != 0:
            raise RuntimeError(
                f"callgrind_control {' '.join(args)} failed for pid {self.svc.pid}:"
                f" is it running under valgrind?\n{self.svc.output()[-2000:]}"
            )

    async def start(self) -> None:
        await self._control("-i", "on")

    async def dump(self) -> Path:
        """Dumps the counters since the last dump (and zeroes them); the dump's file."""
        await self._control("-d")
        self.dumps += 1
        return self.folder / f"cg.out.{self.dumps}"


#: The gateways' environment per `--otlp`: where the OTLP/HTTP receiver is named ({url}).
OTLP_ENV = {
    "off": {},
    "metrics": {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "{url}/v1/metrics"},
    "traces": {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "{url}/v1/traces"},
    "both": {"OTEL_EXPORTER_OTLP_ENDPOINT": "{url}", "OTEL_METRICS_EXPORTER": "otlp"},
}


async def _target(
    sim_url: str,
    src: str | None,
    args: argparse.Namespace,
    otlp: dict[str, str],
    trust: dict[str, str],
    shared: tuple[str, ...],
) -> dict[str, Any]:
    api, kind = API_PATHS[args.path]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.keep:  # the dumps kept for callgrind_annotate, a folder a target
            folder = Path(args.keep) / (src or "this tree").strip("./").replace("/", "_")
            folder.mkdir(parents=True, exist_ok=True)
        prefix = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
        prefix += [f"--callgrind-out-file={folder / 'cg.out'}", sys.executable]
        # PYTHONHASHSEED: the same dict and set layouts in every run and target.
        env = {"PYTHONHASHSEED": "0", **(otlp if src not in (RELAY, READING_RELAY) else {})}
        env.update(trust)  # (--tls: the throw-away CA, for every target)
        upstream = upstream_args(kind, sim_url)
        logs: tuple[str, ...] = ACCESS_LOG_ARGS if args.access_log else ()
        logs += shared if src not in (RELAY, READING_RELAY) else ()
        with gateway_under(
            sim_url, src, prefix, env, timeout=300, upstream=upstream, serve_args=logs
        ) as svc:
            key = BENCH_KEY if args.key_quotas else None
            counted = Counted(svc, folder, key)
            shape = {"api": api, "model": args.model, "messages": args.messages}
            shape["api_key"] = key
            if args.whole:  # non-streamed answers, counted as the streamed ones are
                shape_whole = {"model": args.model, "api": api, "api_key": key}

                async def load(n: int, prompt: int = 32) -> None:
                    await whole_answers(svc, args.concurrency, n, prompt, **shape_whole)
            else:

                async def load(n: int, prompt: int = 32) -> None:
                    await one_token_requests(svc, args.concurrency, n, prompt, **shape)

            await load(args.warmup)
            await counted.start()
            await load(args.warmup)
            await counted.dump()  # the warm-up, dropped
            short: list[float] = []
            long: list[float] = []
            functions: dict[str, tuple[int, str]] = {}
            for r in range(args.rounds):
                print(f"    round {r + 1}/{args.rounds}", flush=True)
                await load(args.requests, args.prompt)
                path = await counted.dump()
                short.append(_totals(path) / (args.requests + 1))
                for name, (n, obj) in _by_function(path).items():
                    prev = functions.get(name, (0, obj))
                    functions[name] = (prev[0] + n, obj)
                if args.tokens:
                    await run_load(
                        svc.url + "/v1",
                        "sim-model",
                        concurrency=args.concurrency,
                        requests=args.long_requests,
                        max_tokens=args.tokens,
                        prompt_tokens=32,
                        api=api,
                        api_key=key,
                    )
                    path = await counted.dump()
                    # The request that woke the dump was a 1-token one: its count is taken out.
                    per = (_totals(path) - short[-1]) / args.long_requests
                    long.append((per - short[-1]) / (args.tokens - 1))
    measured = args.rounds * (args.requests + 1)
    return {
        "per_request": median(short),
        "per_request_rounds": short,
        "per_token": median(long) if long else None,
        "per_token_rounds": long,
        "functions": {k: (n / measured, obj) for k, (n, obj) in functions.items()},
    }


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    targets: list[tuple[str, str | None]] = [("this tree", None)]
    targets += [("base", args.base_src)] if args.base_src else []
    targets += [] if args.no_relay else [(RELAY, RELAY)]
    targets += [(READING_RELAY, READING_RELAY)] if args.reading_relay else []
    results: dict[str, Any] = {}
    limits = RATELIMIT_HEADERS_SIM if args.ratelimit_headers else ()
    models = sim_models(args.model)
    with contextlib.ExitStack() as stack:
        sim = stack.enter_context(
            procs.sim("--ttft-ms", "0", "--itl-ms", str(args.itl_ms), *limits, *models)
        )
        otlp: dict[str, str] = {}
        if args.otlp != "off":
            url = stack.enter_context(Receiver()).http_url
            otlp = {k: v.format(url=url) for k, v in OTLP_ENV[args.otlp].items()}
        upstream_url, trust = sim.url, {}
        if args.tls:  # the sim behind nginx terminating TLS: an https upstream
            proxy, ca_file = stack.enter_context(_nginx.tls_proxy(sim.url))
            upstream_url, trust = proxy.url, {"SSL_CERT_FILE": str(ca_file)}
        redis = stack.enter_context(RedisServer()) if args.redis else None
        for i, (name, src) in enumerate(targets):
            print(f"  {name}", flush=True)
            config = ""
            if redis is not None:  # the buckets in a redis-server: each target its own keys
                config += redis_limits(redis.url, f"target{i}")
            if args.key_quotas:  # auth on, one key, quotas far above the load
                config += KEY_QUOTAS
            shared: tuple[str, ...] = ()
            if config:
                shared = ("--config", str(config_file(f"instructions-{i}", config)))
            results[name] = await _target(upstream_url, src, args, otlp, trust, shared)
    return results


def _print(results: dict[str, Any], args: argparse.Namespace) -> None:
    names = list(results)
    relay = results.get(RELAY)
    print(
        f"\nInstructions (callgrind Ir, user space) per 1-token request, {args.path},"
        f" {f'{args.messages} messages' if args.messages else f'{args.prompt}-token prompt'},"
        f" model {args.model}, {args.rounds} rounds"
    )
    print(f"{'target':<12} {'a request':>10} {'rounds':>19} {'x relay':>8} {'a token':>9}")
    for name in names:
        r = results[name]
        rounds = r["per_request_rounds"]
        span = f"{min(rounds) / 1e3:,.1f}-{max(rounds) / 1e3:,.1f}k"
        ratio = f"{r['per_request'] / relay['per_request']:.2f}" if relay else "-"
        token = f"{r['per_token'] / 1e3:,.1f}k" if r["per_token"] is not None else "-"
        print(f"{name:<12} {r['per_request'] / 1e3:>9,.1f}k {span:>19} {ratio:>8} {token:>9}")
    heads = "".join(f"{n[:10]:>11}" for n in names)
    print(f"\n{'kind (instructions a request, thousands)':<44}{heads}")
    kinds: dict[str, dict[str, float]] = {}
    for name in names:
        for fn, (n, obj) in results[name]["functions"].items():
            kind = _kind(fn, obj)
            kinds.setdefault(kind, {}).setdefault(name, 0.0)
            kinds[kind][name] += n
    for kind in sorted(kinds, key=lambda k: -kinds[k].get(names[0], 0.0)):
        row = "".join(f"{kinds[kind].get(n, 0.0) / 1e3:>11,.1f}" for n in names)
        print(f"{kind:<44}{row}")
    if args.top:
        mine = results[names[0]]["functions"]
        heads = "".join(f"{n[:9]:>10}" for n in names)
        print(f"\n{'function (own instructions a request)':<58}{heads}")
        for fn in sorted(mine, key=lambda k: -mine[k][0])[: args.top]:
            row = "".join(f"{results[n]['functions'].get(fn, (0.0, ''))[0]:>10,.0f}" for n in names)
            print(f"{fn[-58:]:<58}{row}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=500, help="1-token requests a round")
    p.add_argument("--warmup", type=int, default=200, help="requests before counting, and after")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--prompt", type=int, default=32, help="the measured requests' prompt, in tokens"
    )
    add_request_shape(p)  # --path, --messages, --model, --ratelimit-headers, --key-quotas
    p.add_argument("--tokens", type=int, default=0, help="tokens of the long requests (0: none)")
    p.add_argument("--long-requests", type=int, default=20, help="long requests a round")
    p.add_argument(
        "--itl-ms",
        type=float,
        default=0.0,
        help="the sim's gap between tokens (0: a long answer's events arrive together, a few"
        " to a read; 2: one a read, as from a paced model)",
    )
    p.add_argument("--base-src", help="add tokenpipe run from this src/ directory (PYTHONPATH)")
    p.add_argument("--no-relay", action="store_true", help="leave the bare relay out")
    p.add_argument(
        "--reading-relay", action="store_true", help="+ the relay decoding what it forwards"
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        help="the gateways log a line a request (serve --access-log, the log thread's "
        "instructions counted too)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="the upstream over https: the sim behind nginx terminating TLS (a throw-away CA)",
    )
    p.add_argument(
        "--redis",
        action="store_true",
        help="the gateways keep their buckets in a redis-server (limits.backend: redis; the"
        " relays have none)",
    )
    p.add_argument(
        "--whole",
        action="store_true",
        help="the measured requests ask for a whole answer (stream false), not a stream",
    )
    p.add_argument(
        "--otlp",
        choices=list(OTLP_ENV),
        default="off",
        help="the gateways export to an OTLP/HTTP receiver on loopback: the GenAI metrics, "
        "every request's spans, or both (the export threads' instructions counted too)",
    )
    p.add_argument("--top", type=int, default=15, help="functions listed (0: none)")
    p.add_argument("--keep", help="keep each target's dumps in a folder under this one")
    p.add_argument("--json", default="results/request_instructions.json")
    args = p.parse_args()
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            p.error(f"{tool} is not on PATH (Debian: apt install valgrind)")
    if args.tokens == 1 or args.tokens < 0:
        p.error("--tokens must be 0 (no long requests) or at least 2")
    results = asyncio.run(_bench(args))
    _print(results, args)
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "functions"} for k, v in results.items()}
    top = {
        k: dict(sorted(v["functions"].items(), key=lambda kv: -kv[1][0])[:200])
        for k, v in results.items()
    }
    write_json(args.json, "request_instructions", args, targets=summary, functions=top)


if __name__ == "__main__":
    main()
