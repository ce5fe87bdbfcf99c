"""What an upstream that dribbles a large SSE event costs the gateway's decoder (sse.py): CPU
seconds to decode one event of `--event-mib` MiB arriving in reads of 1 KiB, 16 KiB and
256 KiB (a slow link, a typical TCP read, uvloop's largest read), for this tree and, with
`--base-src`, another checkout's, side by side in one run. Each target runs in a child
process of its own (PYTHONPATH=its src), rounds interleaved, medians.

    python benchmarks/sse_decode.py                          # ~10 s
    python benchmarks/sse_decode.py --base-src ../base/src   # before/after

An event is bounded (4 MiB by default) but a decoder that joins what it holds at every
read copies the event again with each read: quadratic in reads. A large event is not only
a hostile upstream's: a Responses API `response.completed` event carries the whole answer.
JSON in results/sse_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _common import ROOT, src_dir, write_json

READS = (1024, 16384, 262144)

_CHILD = """
import json, sys, time
from tokenpipe.sse import SSEDecoder
size, reads = int(sys.argv[1]), [int(x) for x in sys.argv[2:]]
data = b"data: " + b"a" * (size - 8) + b"\\n\\n"
out = {}
for read in reads:
    chunks = [data[i : i + read] for i in range(0, len(data), read)]
    d = SSEDecoder(max_event_bytes=size)
    t = time.process_time()
    events = [e for c in chunks for e in d.feed(c)]
    out[read] = time.process_time() - t
    assert len(events) == 1 and len(events[0].data) == size - 8, "one whole event"
print(json.dumps(out))
"""


def _run(src: str, size: int) -> dict[int, float]:
    env = {**os.environ, "PYTHONPATH": src}
    argv = [sys.executable, "-c", _CHILD, str(size), *map(str, READS)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(done.stdout).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--event-mib", type=float, default=4.0, help="the event's size (MiB)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--base-src", type=src_dir, help="src/ of another checkout, measured too")
    p.add_argument("--json", default=str(ROOT / "results" / "sse_decode.json"))
    args = p.parse_args()
    size = int(args.event_mib * 1024 * 1024)
    targets = {"this tree": str(ROOT / "src")}
    if args.base_src:
        targets["base"] = args.base_src
    seconds: dict[str, dict[int, list[float]]] = {t: {r: [] for r in READS} for t in targets}
    for i in range(args.rounds):
        for name, src in targets.items():
            print(f"  round {i + 1}/{args.rounds} {name}", flush=True)
            for read, s in _run(src, size).items():
                seconds[name][read].append(s)
    print(f"\nCPU to decode one {args.event_mib:g} MiB event, by read size (median)")
    print(f"{'target':<12}" + "".join(f"{f'{r // 1024} KiB reads':>16}" for r in READS))
    rows = []
    for name in targets:
        med = {r: statistics.median(v) for r, v in seconds[name].items()}
        print(f"{name:<12}" + "".join(f"{med[r] * 1e3:>13.1f} ms" for r in READS))
        rows.append({"target": name, "cpu_seconds": med, "rounds": seconds[name]})
    write_json(args.json, "sse_decode", args, event_bytes=size, rows=rows)


if __name__ == "__main__":
    main()
