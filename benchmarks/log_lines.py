"""What a log line costs the thread that logs it (the gateway's event loop): the access-log
line `front/http.py` writes, as it writes it (`logs.access` where the tree has it, else a
record on the `tokenpipe.access` logger), through the logging `tokenpipe serve` sets up
(`observe.logs.configure`), for this tree and, with `--base-src`, another checkout, side by
side in one run, to /dev/null and to a pipe that another thread drains.

    python benchmarks/log_lines.py                               # ~20 s
    python benchmarks/log_lines.py --base-src ../base/src --rounds 7

Each round runs one child process a target, sink and format (`child_figure`): stderr is made
the sink (dup2), `configure` sets up the logging as `serve --log-format FMT` does, and
`--lines` records are logged, timed on the logging thread (time.perf_counter). The figure
is the median round's microseconds a line. A log thread's writing is its own thread's, and
not in the figure; what it is for does not show here either: with a pipe nobody reads, a
write on the loop stops at the ~400th line and the log thread never does
(tests/test_log_writer.py). JSON in results/log_lines.json.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from _common import child_figure, src_targets, write_json

_CHILD = r"""
import json, logging, os, sys, threading, time
sink, fmt, lines = sys.argv[1], sys.argv[2], int(sys.argv[3])
if sink == "pipe":
    r, w = os.pipe()
    def drain():
        while os.read(r, 1 << 16):
            pass
    threading.Thread(target=drain, daemon=True).start()
    os.dup2(w, 2)
else:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
from tokenpipe.observe import logs
logs.configure("info", fmt)
log = logging.getLogger("tokenpipe.access")
direct = getattr(logs, "access", None)  # front/http.py's way, where the tree has it
path = "/v1/chat/completions"
start = time.perf_counter()
for i in range(lines):
    if not log.isEnabledFor(logging.INFO):
        continue
    seconds = 0.001234
    fields = {"request_id": f"req-{i}", "method": "POST", "path": path, "status": 200,
              "duration_ms": round(seconds * 1000, 3)}
    if direct is not None:
        direct(f"POST {path} 200 {seconds * 1000:.1f} ms", fields)
    else:
        log.info("%s %s %d %.1f ms", "POST", path, 200, seconds * 1000, extra=fields)
took = time.perf_counter() - start
logging.shutdown()
print(json.dumps(took / lines * 1e6))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=20_000, help="lines a child logs")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--base-src", help="src/ of another checkout, measured beside this one")
    p.add_argument("--json", default="results/log_lines.json")
    args = p.parse_args()
    targets = src_targets(args.base_src)
    cases = [
        (name, sink, fmt)
        for sink in ("/dev/null", "pipe")
        for fmt in ("text", "json")
        for name in targets
    ]
    runs: dict[tuple[str, str, str], list[float]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for c in cases:  # interleaved: the host's drift falls on all alike
            name, sink, fmt = c
            runs[c].append(child_figure(targets[name], _CHILD, sink, fmt, str(args.lines)))
    rows: list[dict[str, Any]] = []
    print(f"{'sink':<10} {'format':<6} {'target':<10} {'us a line':>9} {'range':>13}")
    for (name, sink, fmt), got in runs.items():
        med = statistics.median(got)
        rows.append({"target": name, "sink": sink, "format": fmt, "us": med, "runs": got})
        span = f"{min(got):.2f}-{max(got):.2f}"
        print(f"{sink:<10} {fmt:<6} {name:<10} {med:>9.2f} {span:>13}")
    write_json(args.json, "log_lines", args, rows=rows)


if __name__ == "__main__":
    main()
