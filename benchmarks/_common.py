"""Small helpers shared by the benchmarks (process CPU, ports, the processes compared, JSON)."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import psutil

from tokenpipe.bench.procs import Service

ROOT = Path(__file__).resolve().parent.parent


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process and its children so far (0 for None)."""
    if pid is None:
        return 0.0
    p = psutil.Process(pid)
    total = sum(p.cpu_times()[:2])
    for child in p.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fmt(v: float | None, width: int, digits: int = 2) -> str:
    """A table cell: the number, or '-' where there is none (e.g. no ITL in 1-chunk streams)."""
    return f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"


def gateway(sim_url: str, grpc_port: int = 0) -> Service:
    """`tokenpipe serve` with its defaults in front of a sim (base URL without /v1)."""
    return Service(
        "serve",
        "--port",
        "0",
        "--grpc-port",
        str(grpc_port),
        "--upstream",
        sim_url + "/v1",
        "--log-level",
        "warning",
        name="gateway",
    )


def bare_relay(sim_url: str, cpu_us: float = 0.0) -> Service:
    """The byte-forwarding floor (benchmarks/bare_relay.py) in front of a sim; `cpu_us`:
    CPU it spins per request (a diagnostic)."""
    return Service(
        argv=[
            sys.executable,
            str(ROOT / "benchmarks" / "bare_relay.py"),
            "--upstream",
            sim_url,
            "--cpu-us",
            str(cpu_us),
        ],
        name="bare-relay",
    )


def write_json(path: str, benchmark: str, args: Any, **result: Any) -> None:
    """Saves a benchmark's result with its arguments and the machine's core count."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": benchmark, "args": vars(args), "cpus": os.cpu_count(), **result}
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")
