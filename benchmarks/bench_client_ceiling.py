"""How much the bench client can measure before it is the bottleneck (its `--self-test`).

One unpaced sim (`--ttft-ms 0 --itl-ms 0`); configurations run interleaved, 3 rounds each, and
the table shows medians with the ratio against the first configuration (SSE, one process):

    .venv/bin/python benchmarks/bench_client_ceiling.py [--requests 600] [--json PATH]

Two loads: long answers (256 tokens: the token rate ceiling) and one-token answers (the
request rate ceiling). On a 2-core machine the sim holds one core, so `--processes 2` shows
whether a second client process helps or only competes with the sim.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from tokenpipe.bench import run_load_processes
from tokenpipe.bench.selftest import own_cpu_s, process_cpu_s, unpaced_sim

CONFIGS = [  # (name, protocol, processes)
    ("sse, 1 process", "sse", 1),
    ("sse, 2 processes", "sse", 2),
    ("h2 (httpx), 1 process", "h2", 1),
]
LOADS = [("256 tokens/request", 256, 32), ("1 token/request", 1, 32)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="results/bench_client_ceiling.json")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with unpaced_sim(256) as (url, sim_pid):
        for load, tokens, conc in LOADS:
            samples: dict[str, list[tuple[float, float, float, float]]] = {}
            for _ in range(args.rounds):
                for name, proto, procs in CONFIGS:
                    requests = args.requests if proto != "h2" else args.requests // 2
                    cpu0, sim0, t0 = own_cpu_s(), process_cpu_s(sim_pid), time.perf_counter()
                    r = run_load_processes(
                        procs,
                        url,
                        "m",
                        concurrency=conc,
                        requests=requests,
                        max_tokens=tokens,
                        protocols=(proto,),
                        warmup=8,
                    )
                    wall = time.perf_counter() - t0
                    s = r.summary()
                    samples.setdefault(name, []).append(
                        (
                            s.output_tokens / r.wall_s,
                            s.requests_ok / r.wall_s,
                            (own_cpu_s() - cpu0) / wall,
                            (process_cpu_s(sim_pid) - sim0) / wall,
                        )
                    )
            base = None
            for name, _, procs in CONFIGS:
                vals = samples[name]
                tps = statistics.median(v[0] for v in vals)
                rps = statistics.median(v[1] for v in vals)
                base = base or (tps, rps)
                rows.append(
                    {
                        "load": load,
                        "config": name,
                        "processes": procs,
                        "tokens_per_s": round(tps),
                        "requests_per_s": round(rps, 1),
                        "ratio_tokens": round(tps / base[0], 2),
                        "ratio_requests": round(rps / base[1], 2),
                        "client_cpu_cores": round(statistics.median(v[2] for v in vals), 2),
                        "sim_cpu_cores": round(statistics.median(v[3] for v in vals), 2),
                        "rounds": len(vals),
                    }
                )
    print(
        f"{'load':<20} {'config':<24} {'tokens/s':>10} {'req/s':>8} {'ratio':>6} "
        f"{'client CPU':>10} {'sim CPU':>8}"
    )
    for row in rows:
        ratio = row["ratio_tokens"] if row["load"].startswith("256") else row["ratio_requests"]
        print(
            f"{row['load']:<20} {row['config']:<24} {row['tokens_per_s']:>10,} "
            f"{row['requests_per_s']:>8,.1f} {ratio:>5.2f}x {row['client_cpu_cores']:>10.2f} "
            f"{row['sim_cpu_cores']:>8.2f}"
        )
    print("medians of", args.rounds, "interleaved rounds; CPU in cores (1.0 = one core busy)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "bench_client_ceiling", "rows": rows}, indent=2))
    print("wrote", out)


if __name__ == "__main__":
    main()
