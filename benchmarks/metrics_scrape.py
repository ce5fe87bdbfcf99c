"""What a scrape of /metrics costs the event loop, by the series the gateway holds: the text
rendered for `U x M` upstream-model pairs that each served requests (every per-request
family has a series a pair), for this tree and, with `--base-src`, another checkout, side
by side.

    python benchmarks/metrics_scrape.py                             # ~1 min
    python benchmarks/metrics_scrape.py --base-src ../base/src --pairs 100,1000,10000

The scrape runs on the event loop: every stream waits for it, each time Prometheus asks
(every 15 s by default). Each figure is the median of `--rounds` renders, each in a child
process (PYTHONPATH=its src) that first fills the series as requests would (TTFT, gaps,
time per token, duration, a status count, in flight, the three deadlines, the circuit's
state), then times one `render()`
(its process CPU); and, scraped as the gateway scrapes, the longest a task that wants
every turn of the event loop waits meanwhile (a stream's wait for its next write). JSON in
results/metrics_scrape.json.
"""

from __future__ import annotations

import argparse
import statistics

from _common import child_figure, src_targets, write_json

_CHILD = r"""
import asyncio, json, sys, time
from tokenpipe.observe import metrics as m

pairs = int(sys.argv[1])
upstreams = max(1, int(pairs ** 0.5))
models = pairs // upstreams
for j in range(models):
    m.allow_model(f"model-{j}")
for u in range(upstreams):
    for j in range(models):
        labels = ("chat", f"upstream-{u}", f"model-{j}")
        m.child(m.TTFT, *labels).observe(0.1)
        m.child(m.ITL, *labels).observe(0.01)
        m.child(m.TPOT, *labels).observe(0.01)
        m.child(m.REQUEST_DURATION, *labels).observe(1.0)
        m.child(m.REQUESTS, "200", *labels).inc()
        m.child(m.INFLIGHT, *labels).inc()
        for kind in ("ttft", "stall", "hedge_delay"):
            m.child(m.DEADLINE, kind, labels[1], labels[2]).set(2.5)
    m.UPSTREAM_STATE.labels(f"upstream-{u}").set(0)
m.render()  # once: anything made on the first scrape


async def longest_wait():
    # The longest a task that asks for every turn of the loop waits while a scrape runs.
    longest, done = 0.0, False

    async def ticker():
        nonlocal longest
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    if hasattr(m, "render_async"):
        await m.render_async()
    else:  # a checkout that renders on the loop in one go
        m.render()
    done = True
    await task
    return longest * 1e3


if sys.argv[2] == "wait":
    print(json.dumps(asyncio.run(longest_wait())))
else:
    t = time.process_time_ns()
    text = m.render()
    took = (time.process_time_ns() - t) / 1e6
    print(json.dumps(text.count(b"\n") if sys.argv[2] == "lines" else took))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--pairs",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[100, 1000],
        help="upstream-model pairs with series, comma-separated",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--base-src", help="add another checkout's src/ (PYTHONPATH)")
    p.add_argument("--json", default="results/metrics_scrape.json")
    args = p.parse_args()
    targets = src_targets(args.base_src)
    rows = []
    for pairs in args.pairs:
        ms: dict[str, list[float]] = {name: [] for name in targets}
        waits: dict[str, list[float]] = {name: [] for name in targets}
        lines = {
            name: child_figure(src, _CHILD, str(pairs), "lines") for name, src in targets.items()
        }
        for r in range(args.rounds):
            for name in list(targets)[r % 2 :] + list(targets)[: r % 2]:
                print(f"  {pairs} pairs, round {r + 1}/{args.rounds}, {name}", flush=True)
                ms[name].append(child_figure(targets[name], _CHILD, str(pairs), "ms"))
                waits[name].append(child_figure(targets[name], _CHILD, str(pairs), "wait"))
        for name in targets:
            rows.append(
                {
                    "pairs": pairs,
                    "target": name,
                    "lines": lines[name],
                    "ms_rounds": ms[name],
                    "wait_ms_rounds": waits[name],
                }
            )
    print(
        f"\n{'pairs':>6}  {'target':<10} {'lines':>8} {'ms a scrape':>11} {'us a line':>9}", end=""
    )
    print(f" {'longest wait':>13}")
    for row in rows:
        med = statistics.median(row["ms_rounds"])
        per = med * 1e3 / row["lines"]
        wait = statistics.median(row["wait_ms_rounds"])
        print(f"{row['pairs']:>6}  {row['target']:<10} {row['lines']:>8.0f} {med:11.1f}", end="")
        print(f" {per:9.2f} {wait:10.1f} ms")
    write_json(args.json, "metrics_scrape", args, rows=rows)


if __name__ == "__main__":
    main()
