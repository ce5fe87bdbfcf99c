"""What one request and one token cost the gateway, against the bare relay: CPU microseconds of
the serving process per request (1-token answers: the request path) and per token (long
answers, the request path subtracted), interleaved round by round, one sim for both.

    python benchmarks/relay_cost.py                       # ~2 min; JSON in results/relay_cost.json
    python benchmarks/relay_cost.py --rounds 5 --concurrency 32
    python benchmarks/relay_cost.py --features-off        # + tokenpipe with its layers off
    python benchmarks/relay_cost.py --tracing off,on,sampled  # one gateway per mode
    python benchmarks/relay_cost.py --tracing off,metrics    # + the GenAI metrics alone
    python benchmarks/relay_cost.py --base-src ../old/src  # + tokenpipe of another checkout
    python benchmarks/relay_cost.py --ratelimit-headers   # answers carry x-ratelimit-*
    python benchmarks/relay_cost.py --redis --base-src ../old/src  # limits shared via Redis
    python benchmarks/relay_cost.py --key-quotas --redis --ratelimit-headers  # a deployment

`--tracing` (a list) sets each gateway's OpenTelemetry environment: `off` (the default: no
endpoint), `on` (every request sampled, spans batched to an OTLP/HTTP receiver on loopback
that only counts them, tests/otlp_receiver.py) or `sampled` (the same receiver, 1 request in
100 sampled: OTEL_TRACES_SAMPLER=traceidratio, OTEL_TRACES_SAMPLER_ARG=0.01) or `metrics`
(the GenAI metrics alone, OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, no traces). `--base-src`
adds a gateway run from another checkout's src/ (PYTHONPATH) in each `--tracing` mode, for
before/after in one run.

The overhead benchmark (`overhead.py`) shows latency and throughput under load; this one says
where the gateway's CPU goes, which is what sets them once the machine is saturated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from pathlib import Path
from typing import Any

from _common import (
    BENCH_KEY,
    KEY_QUOTAS,
    RATELIMIT_HEADERS_SIM,
    ROOT,
    add_deployment_options,
    bare_relay,
    config_file,
    cpu_seconds,
    features_off_config,
    gateway,
    redis_limits,
    write_json,
)

sys.path.insert(0, str(ROOT))  # tests/ (the OTLP receiver of --tracing)

from tests.otlp_receiver import Receiver
from tests.redis_server import RedisServer
from tokenpipe.bench import run_load
from tokenpipe.bench.procs import Service
from tokenpipe.serving import install_uvloop

MODEL = "sim-model"


async def _cpu_per(
    svc: Service, concurrency: int, requests: int, max_tokens: int, key: str | None = None
) -> float:
    """CPU seconds of the serving process per request for this load (`key`: its API key)."""
    before = cpu_seconds(svc.pid)
    await run_load(
        svc.url + "/v1",
        MODEL,
        concurrency=concurrency,
        requests=requests,
        max_tokens=max_tokens,
        prompt_tokens=32,
        api_key=key,
    )
    return (cpu_seconds(svc.pid) - before) / requests


#: The gateway's environment per `--tracing` (the receiver's URL filled in).
SAMPLERS = {
    "on": {"OTEL_TRACES_SAMPLER": "always_on"},
    "sampled": {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"},
}


def _tracing_env(mode: str, receiver: Receiver | None) -> dict[str, str] | None:
    if mode == "off" or receiver is None:
        return None
    if mode == "metrics":
        return {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": receiver.http_url + "/v1/metrics"}
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        **SAMPLERS[mode],
    }


#: Target names per --tracing mode.
TRACED_NAMES = {
    "off": "tokenpipe",
    "on": "traced-all",
    "sampled": "traced-1%",
    "metrics": "metrics-only",
}
BASE_NAMES = {
    "off": "tokenpipe-base",
    "on": "base-traced-all",
    "sampled": "base-traced-1%",
    "metrics": "base-metrics",
}


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    traced = any(mode != "off" for mode in args.tracing)
    with contextlib.ExitStack() as stack:
        receiver = stack.enter_context(Receiver()) if traced else None
        limits = RATELIMIT_HEADERS_SIM if args.ratelimit_headers else ()
        sim = stack.enter_context(
            Service("sim", "--port", "0", "--ttft-ms", "20", "--itl-ms", "5", *limits, name="sim")
        )
        targets: dict[str, Service] = {}
        redis = stack.enter_context(RedisServer()) if args.redis else None

        def shared(name: str) -> Path | None:
            """The gateway's config: with --redis its buckets in the one redis-server, under
            keys of its own; with --key-quotas auth on and a quota per key."""
            text = KEY_QUOTAS if args.key_quotas else ""
            if redis is not None:
                text += redis_limits(redis.url, name)
            return config_file(f"relay-cost-{name}", text) if text else None

        for mode in args.tracing:
            env = _tracing_env(mode, receiver)
            name = TRACED_NAMES[mode]
            targets[name] = stack.enter_context(gateway(sim.url, env=env, config=shared(name)))
            if args.base_src:  # the other checkout in each tracing mode too
                base_env = {**(env or {}), "PYTHONPATH": args.base_src}
                name = BASE_NAMES[mode]
                other = gateway(sim.url, env=base_env, config=shared(name))
                targets[name] = stack.enter_context(other)
        targets["bare-relay"] = stack.enter_context(bare_relay(sim.url))
        if args.features_off:
            off = gateway(sim.url, config=features_off_config())
            targets["tokenpipe-off"] = stack.enter_context(off)
        key = BENCH_KEY if args.key_quotas else None
        for svc in targets.values():  # warm-up: connections, caches, estimators
            await _cpu_per(svc, args.concurrency, args.concurrency * 2, 4, key)
        per_request: dict[str, list[float]] = {name: [] for name in targets}
        per_token: dict[str, list[float]] = {name: [] for name in targets}
        for r in range(args.rounds):
            order = list(targets.items())[r % 2 :] + list(targets.items())[: r % 2]
            for name, svc in order:
                print(f"  round {r + 1}/{args.rounds} {name}", flush=True)
                req = await _cpu_per(svc, args.concurrency, args.short_requests, 1, key)
                long = await _cpu_per(svc, args.concurrency, args.long_requests, args.tokens, key)
                per_request[name].append(req * 1e6)
                per_token[name].append(max(0.0, long - req) / args.tokens * 1e6)
        rows: list[dict[str, Any]] = []
        for name in targets:
            rows.append(
                {
                    "target": name,
                    "us_per_request": statistics.median(per_request[name]),
                    "us_per_token": statistics.median(per_token[name]),
                    "rounds_us_per_request": per_request[name],
                    "rounds_us_per_token": per_token[name],
                }
            )
        if receiver is not None:
            print(f"\nspans exported: {len(receiver.received.spans)}")
        base = next(row for row in rows if row["target"] == "bare-relay")
        # Each round's ratio to the relay's in the same round (the host's drift cancels):
        # their median and range, as request_cpu.py shows them.
        print(
            f"\n{'target':<15} {'us/request':>11} {'x relay, per round':>19}"
            f" {'us/token':>9} {'x relay':>8}"
        )
        for row in rows:
            ratios = [
                a / b
                for a, b in zip(
                    row["rounds_us_per_request"], base["rounds_us_per_request"], strict=True
                )
            ]
            row["x_relay_per_round"] = ratios
            ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            print(
                f"{row['target']:<15} {row['us_per_request']:11.0f} {ratio:>19} "
                f"{row['us_per_token']:9.1f} {row['us_per_token'] / base['us_per_token']:8.2f}"
            )
        return {"rows": rows, "tracing": args.tracing}


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in TRACED_NAMES]
    if bad or not modes:
        known = ", ".join(TRACED_NAMES)
        raise argparse.ArgumentTypeError(f"tracing modes are {known} (got {text!r})")
    return list(dict.fromkeys(modes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--short-requests", type=int, default=800, help="1-token requests per round")
    p.add_argument("--long-requests", type=int, default=64, help="long requests per round")
    p.add_argument("--tokens", type=int, default=400, help="tokens per long request")
    p.add_argument(
        "--features-off", action="store_true", help="add tokenpipe with every optional layer off"
    )
    p.add_argument(
        "--tracing",
        type=_modes,
        default=["off"],
        help="tokenpipe's OpenTelemetry, a list of off, on (every request), sampled (1 in 100), "
        "metrics (the GenAI metrics alone)",
    )
    p.add_argument("--base-src", help="add tokenpipe run from this src/ directory (PYTHONPATH)")
    add_deployment_options(p)  # --ratelimit-headers, --key-quotas
    p.add_argument(
        "--redis",
        action="store_true",
        help="the gateways keep their buckets in a redis-server (limits.backend: redis); the"
        " relay has none. Its CPU is not counted (another process)",
    )
    p.add_argument("--json", default=str(ROOT / "results" / "relay_cost.json"))
    args = p.parse_args()
    if args.base_src:
        args.base_src = str(Path(args.base_src).resolve())
    install_uvloop()
    result = asyncio.run(_bench(args))
    write_json(args.json, "relay_cost", args, **result)


if __name__ == "__main__":
    main()
