"""A gateway process's first request: its first token and its own phases (Server-Timing),
for this tree and another checkout, each started anew for every round, one sim for all.
What a new process (a deploy, a restart, each worker of `serve --workers`, a replica that
scales up) makes its first client wait for beyond what the requests after it wait.

    python benchmarks/first_request.py --base-src ../base/src     # ~1 min
    python benchmarks/first_request.py --rounds 10 --settle-s 1

Each round starts the gateway, waits `--settle-s` (a process does not take its first request
the instant it listens), sends one streamed chat request (c1_anatomy.py's blocking client),
then `--after` more 10 ms apart, and stops it. Targets alternate their order by round.
JSON in results/first_request.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import ROOT, gateway, src_dir, write_json
from c1_anatomy import PHASES, Client, _body

from tokenpipe.bench.procs import sim


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--settle-s", type=float, default=1.0, help="from listening to the request")
    p.add_argument("--after", type=int, default=10, help="requests after the first, each round")
    p.add_argument("--base-src", type=src_dir, help="+ tokenpipe from another src/")
    p.add_argument("--json", default=str(ROOT / "results" / "first_request.json"))
    args = p.parse_args()
    srcs: dict[str, str | None] = {"tokenpipe": None}
    if args.base_src:
        srcs["tp-base"] = args.base_src
    first: dict[str, list[float]] = {n: [] for n in srcs}
    later: dict[str, list[float]] = {n: [] for n in srcs}
    phases: dict[str, dict[str, list[float]]] = {n: {ph: [] for ph in PHASES} for n in srcs}
    body = _body(4)
    with sim("--ttft-ms", "20", "--itl-ms", "20") as upstream:
        names = list(srcs)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                with gateway(upstream.url, src=srcs[name]) as svc:
                    time.sleep(args.settle_s)  # the scenario: listening, then a request
                    client = Client(svc.url, body)
                    _, f, ph = client.one()
                    first[name].append(f * 1e3)
                    for k in PHASES:
                        phases[name][k].append(ph.get(k, 0.0))
                    for _ in range(args.after):
                        time.sleep(0.01)  # paced by design
                        later[name].append(client.one()[1] * 1e3)
                    client.close()
            shown = "  ".join(f"{n} {first[n][-1]:.2f}" for n in names)
            print(f"  round {r + 1}/{args.rounds}: first request's first token ms {shown}")
    rows = {}
    print(f"\na process's first request, {args.rounds} starts each, medians (ms)")
    print(f"{'target':<10} {'first':>7} {'later':>7} {'extra':>6}  phases of the first")
    for name in names:
        f, w = statistics.median(first[name]), statistics.median(later[name])
        ph = {k: statistics.median(v) for k, v in phases[name].items()}
        rows[name] = {"first_ms": f, "later_ms": w, "phases_ms": ph}
        shown = " ".join(f"{k[:4]} {v:.2f}" for k, v in ph.items())
        print(f"{name:<10} {f:7.2f} {w:7.2f} {f - w:+6.2f}  {shown}")
    write_json(args.json, "first_request", args, rows=rows, first_ms=first, later_ms=later)


if __name__ == "__main__":
    main()
