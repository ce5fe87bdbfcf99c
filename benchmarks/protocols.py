"""Protocol A/B through the gateway: SSE over HTTP/1.1, SSE over HTTP/2 (when the server
speaks it), and gRPC, against the unpaced sim, one stream and 64 concurrent streams.

Rounds interleave the protocols (rotated order), so noise lands on all of them alike. For each:
delivered tokens/s, per-token ITL p50/p99, chunks per request, and gateway CPU seconds per
1,000 tokens. Prints a table and writes JSON.

    python benchmarks/protocols.py
    python benchmarks/protocols.py --concurrency 1,64 --rounds 3 --max-tokens 1000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import cpu_seconds, fmt, free_port, gateway, write_json

from tokenpipe.bench import ProtocolUnavailable, Summary, run_load
from tokenpipe.bench.procs import Service
from tokenpipe.serving import install_uvloop

ROOT = Path(__file__).resolve().parent.parent
MODEL = "sim-model"


@dataclass
class Arm:
    protocol: str
    summary: Summary = field(default_factory=Summary)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    notes: set[str] = field(default_factory=set)
    unavailable: str | None = None


async def _run(
    arm: Arm, url: str, grpc_url: str, pid: int, concurrency: int, requests: int, max_tokens: int
) -> None:
    cpu0 = cpu_seconds(pid)
    try:
        result = await run_load(
            url,
            MODEL,
            concurrency=concurrency,
            requests=requests,
            max_tokens=max_tokens,
            prompt_tokens=32,
            protocols=(arm.protocol,),
            grpc_url=grpc_url,
            h2c=arm.protocol == "h2",
            label=arm.protocol,
        )
    except ProtocolUnavailable as e:
        arm.unavailable = str(e)
        return
    arm.cpu_s += cpu_seconds(pid) - cpu0
    errors = {r.error for r in result.records if r.error}
    if errors and not any(r.ok for r in result.records):
        arm.unavailable = sorted(errors)[0]
        return
    arm.wall_s += result.wall_s
    arm.summary.merge(result.summary())
    arm.notes.update(result.notes)


def _row(arm: Arm) -> dict[str, Any]:
    if arm.unavailable or not arm.summary.requests_ok:
        return {
            "protocol": arm.protocol,
            "unavailable": arm.unavailable or "no request ok",
            "notes": sorted(arm.notes),
        }
    s = arm.summary
    s.wall_s = arm.wall_s
    j = s.to_json()
    return {
        "protocol": arm.protocol,
        "tokens_per_s": j["output_tokens_per_s"],
        "itl_token_p50_ms": j["itl_token_ms"]["p50"],
        "itl_token_p99_ms": j["itl_token_ms"]["p99"],
        "ttft_p50_ms": j["ttft_ms"]["p50"],
        "tokens_per_chunk": j["tokens_per_chunk"],
        "cpu_s_per_1k_tokens": arm.cpu_s / s.output_tokens * 1000,
        "requests_ok": j["requests_ok"],
        "requests_failed": j["requests_failed"],
        "notes": sorted(arm.notes),
    }


def _print(concurrency: int, rows: list[dict[str, Any]]) -> None:
    print(f"\n== unpaced sim, concurrency {concurrency} ==")
    print(
        f"{'protocol':<9} {'tok/s':>9} {'ITL/tok p50':>11} {'p99':>8} {'TTFT p50':>9} "
        f"{'tok/chunk':>9} {'CPU s/1k':>8} {'fail':>5}"
    )
    for r in rows:
        if "unavailable" in r:
            print(f"{r['protocol']:<9} unavailable: {r['unavailable']}")
            continue
        print(
            f"{r['protocol']:<9} {fmt(r['tokens_per_s'], 9, 0)} "
            f"{fmt(r['itl_token_p50_ms'], 11, 3)} {fmt(r['itl_token_p99_ms'], 8, 3)} "
            f"{fmt(r['ttft_p50_ms'], 9)} {fmt(r['tokens_per_chunk'], 9)} "
            f"{fmt(r['cpu_s_per_1k_tokens'], 8, 3)} {r['requests_failed']:5d}"
        )
        for note in r["notes"]:
            print(f"          note: {note}")


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    grpc_port = free_port()
    with (
        Service("sim", "--port", "0", "--ttft-ms", "0", "--itl-ms", "0", name="sim") as sim,
        gateway(sim.url, grpc_port) as gw,
    ):
        grpc_url = f"127.0.0.1:{grpc_port}"
        url = gw.url + "/v1"
        for concurrency in args.concurrency:
            arms = [Arm(p) for p in args.protocols]
            for arm in arms:  # warm-up
                await _run(Arm(arm.protocol), url, grpc_url, gw.pid, concurrency, concurrency, 16)
            for r in range(args.rounds):
                order = arms[r % len(arms) :] + arms[: r % len(arms)]
                for arm in order:
                    if arm.unavailable:
                        continue
                    print(
                        f"  c={concurrency} round {r + 1}/{args.rounds} {arm.protocol}", flush=True
                    )
                    await _run(
                        arm,
                        url,
                        grpc_url,
                        gw.pid,
                        concurrency,
                        concurrency * args.requests_per_stream,
                        args.max_tokens,
                    )
            rows = [_row(a) for a in arms]
            _print(concurrency, rows)
            out.append({"concurrency": concurrency, "rows": rows})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    p.add_argument("--protocols", type=lambda s: s.split(","), default=["sse", "h2", "grpc"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=1000)
    p.add_argument("--json", default=str(ROOT / "results" / "protocols.json"))
    args = p.parse_args()
    install_uvloop()
    results = asyncio.run(_main(args))
    write_json(args.json, "protocols", args, python=sys.version, results=results)


if __name__ == "__main__":
    main()
