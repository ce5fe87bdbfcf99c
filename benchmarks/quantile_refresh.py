"""What the rolling latency quantiles cost (control/quantiles.py): a view of the window
refreshed with the three quantiles a request reads, and a value added, for this tree and,
with `--base-src`, another checkout's, side by side.

    python benchmarks/quantile_refresh.py                           # ~20 s
    python benchmarks/quantile_refresh.py --base-src ../base/src    # before/after, ~40 s

A view is refreshed at most four times a second (`refresh` 0.25 s), per estimator: the TTFT
of an upstream, model and prompt class, an upstream's gaps between tokens. At a few hundred
requests a second that is nothing a request; below, each refresh is shared by fewer
requests, and at 20 a second three views refreshed cost 3 x 4 / 20 = 0.6 refreshes a
request. The table gives that share too.

Each target runs in child processes (PYTHONPATH=its src), `--rounds` rounds interleaved.
A child fills an estimator (60 s window, 6 slices) on a manual clock for `--minutes`
minutes of simulated time at `--rate` values a second, spread as `--spread` says, reading
the quantiles 0.5, 0.95 and 0.99 every 0.25 s (each read after a refresh is due); the figure
is the median round's CPU us a refresh (with its three quantiles) and a value added. The
spreads: `narrow` (lognormal, sigma 0.2, ~50 ms: a steady upstream), `ttft` (sigma 0.7: an
upstream's TTFTs over a minute of mixed prompts), `wide` (log-uniform over 1 ms to 30 s:
stalls among fast answers). JSON in results/quantile_refresh.json.
"""

from __future__ import annotations

import argparse
import statistics

from _common import ROOT, child_figure, src_dir, src_targets, write_json

SPREADS = ("narrow", "ttft", "wide")
#: The views a request reads (TTFT, gaps, the hedge's TTFT) at this many requests a second.
VIEWS, RATE = 3, 20.0

_CHILD = r"""
import json, math, random, sys, time
from tokenpipe.clock import ManualClock
from tokenpipe.control.quantiles import RollingQuantiles

spread, minutes, rate, what = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
rng = random.Random(7)
def value():
    if spread == "narrow":
        return rng.lognormvariate(math.log(0.05), 0.2)
    if spread == "ttft":
        return rng.lognormvariate(math.log(0.05), 0.7)
    return math.exp(rng.uniform(math.log(0.001), math.log(30.0)))
clock = ManualClock()
est = RollingQuantiles(60.0, slices=6, clock=clock)
per_step = rate * 0.25
steps = int(minutes * 240)
owed = 0.0
spent_add = spent_read = 0.0
adds = reads = 0
clock_ns = time.process_time_ns
for step in range(steps):
    clock.advance(0.25)
    owed += per_step
    batch = [value() for _ in range(int(owed))]
    owed -= len(batch)
    t = clock_ns()
    for v in batch:
        est.add(v)
    spent_add += clock_ns() - t
    adds += len(batch)
    if step < 240:  # the first minute fills the window
        continue
    t = clock_ns()
    est.quantile(0.99); est.quantile(0.95); est.quantile(0.5)
    spent_read += clock_ns() - t
    reads += 1
print(json.dumps(spent_read / reads / 1e3 if what == "refresh" else spent_add / adds / 1e3))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--minutes", type=float, default=3.0, help="simulated minutes a round")
    p.add_argument("--rate", type=float, default=200.0, help="values added a second")
    p.add_argument("--base-src", type=src_dir, help="src/ of another checkout, measured too")
    p.add_argument("--json", default=str(ROOT / "results" / "quantile_refresh.json"))
    args = p.parse_args()
    targets = src_targets(args.base_src)
    keys = [(t, s, w) for t in targets for s in SPREADS for w in ("refresh", "add")]
    us: dict[tuple[str, str, str], list[float]] = {k: [] for k in keys}
    for i in range(args.rounds):
        print(f"  round {i + 1}/{args.rounds}", flush=True)
        for target, spread, what in keys:
            argv = (spread, str(args.minutes), str(args.rate), what)
            us[(target, spread, what)].append(child_figure(targets[target], _CHILD, *argv))
    print("\nus of CPU (median of the rounds); a request's share at 20 requests a second")
    print(
        f"{'spread':<8}{'target':<11}{'a refresh':>11}{'(range)':>16}{'an add':>8}{'a request':>11}"
    )
    rows = []
    for spread in SPREADS:
        for target in targets:
            r, a = us[(target, spread, "refresh")], us[(target, spread, "add")]
            share = statistics.median(r) * VIEWS * 4 / RATE
            print(
                f"{spread:<8}{target:<11}{statistics.median(r):>11.1f}"
                f"{f'({min(r):.1f}-{max(r):.1f})':>16}{statistics.median(a):>8.2f}{share:>11.1f}"
            )
            rows.append({"spread": spread, "target": target, "refresh_us": r, "add_us": a})
    write_json(args.json, "quantile_refresh", args, rows=rows)


if __name__ == "__main__":
    main()
