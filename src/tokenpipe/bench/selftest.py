"""`bench --self-test`: the client's own ceiling, measured against an unpaced sim.

The sim sends every token as soon as the socket takes it (`--ttft-ms 0 --itl-ms 0`), so the
figures are what client and sim together sustain; the CPU each used says which one was the
limit (a process near 100% of a core is the bottleneck).
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

_LISTEN = re.compile(rb"listening on (http://[\d.]+:\d+)")
#: Seconds to wait for the sim to print its listening line.
START_TIMEOUT = 30.0


@contextmanager
def unpaced_sim(output_tokens: int, tokens_per_chunk: int = 1) -> Iterator[tuple[str, int]]:
    """Starts `tokenpipe sim` on a free loopback port; yields (base URL, pid)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenpipe",
            "sim",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--ttft-ms",
            "0",
            "--itl-ms",
            "0",
            "--output-tokens",
            str(output_tokens),
            "--tokens-per-chunk",
            str(tokens_per_chunk),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # drained to the end so the sim never blocks on a full pipe
            m = _LISTEN.search(line)
            if m and not found:
                found.append(m.group(1).decode())
                ready.set()
        ready.set()

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        if not ready.wait(START_TIMEOUT) or not found:
            raise RuntimeError("the sim did not start")
        yield found[0] + "/v1", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        t.join(2)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc; 0 where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def own_cpu_s() -> float:
    """CPU seconds of this process and its reaped children (worker processes)."""
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


@dataclass(slots=True)
class Ceiling:
    tokens_per_s: float
    requests_per_s: float
    chunks_per_s: float
    wall_s: float
    client_cpu: float  # share of one core used by the client (all its processes)
    sim_cpu: float  # share of one core used by the sim

    def verdict(self, processes: int) -> str:
        per_proc = self.client_cpu / max(1, processes)
        if per_proc >= 0.85:
            return "the client is the bottleneck (its processes are near 100% of a core each)"
        if self.sim_cpu >= 0.85:
            return "the sim is the bottleneck; the client can measure at least this much"
        return "neither process is saturated (loopback or scheduling limits the rate)"


def run_self_test(
    url: str | None,
    model: str,
    concurrencies: list[int],
    processes: int,
    kwargs: dict[str, Any],
    output_tokens: int,
    console: Any,
    json_path: str | None,
    wide: bool,
) -> None:
    """`bench --self-test`: the client's own ceiling per concurrency, as a table (and JSON)."""
    from contextlib import nullcontext

    from tokenpipe.bench.load import run_load_processes

    ctx: Any = nullcontext((url, 0)) if url else unpaced_sim(output_tokens)
    results = []
    with ctx as (base, sim_pid):
        for c in concurrencies:
            cpu0, sim0, t0 = (
                own_cpu_s(),
                process_cpu_s(sim_pid) if sim_pid else 0.0,
                time.perf_counter(),
            )
            run = run_load_processes(
                processes,
                base,
                model,
                concurrency=c,
                label=f"c={c}",
                **{**kwargs, "max_tokens": output_tokens},
            )
            wall = time.perf_counter() - t0
            cpu = own_cpu_s() - cpu0
            sim_cpu = (process_cpu_s(sim_pid) - sim0) if sim_pid else 0.0
            s = run.summary()
            ceiling = Ceiling(
                tokens_per_s=s.output_tokens / run.wall_s if run.wall_s else 0.0,
                requests_per_s=s.requests_ok / run.wall_s if run.wall_s else 0.0,
                chunks_per_s=s.chunks / run.wall_s if run.wall_s else 0.0,
                wall_s=run.wall_s,
                client_cpu=cpu / wall,
                sim_cpu=sim_cpu / wall,
            )
            results.append((c, run, ceiling))
    from tokenpipe.bench.table import ceiling_table

    title = f"client ceiling ({processes} process(es), {output_tokens} tokens/request, unpaced sim)"
    ceiling_table(console, title, results, processes, wide=wide)
    if json_path:
        doc = {
            "self_test": [
                {
                    "concurrency": c,
                    "processes": processes,
                    "output_tokens": output_tokens,
                    "tokens_per_s": round(ce.tokens_per_s, 1),
                    "chunks_per_s": round(ce.chunks_per_s, 1),
                    "requests_per_s": round(ce.requests_per_s, 2),
                    "client_cpu_cores": round(ce.client_cpu, 3),
                    "sim_cpu_cores": round(ce.sim_cpu, 3),
                    "verdict": ce.verdict(processes),
                    "summary": run.summary().to_json(),
                }
                for c, run, ce in results
            ]
        }
        Path(json_path).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        console.print(f"wrote {json_path}")
