"""Small helpers shared by the benchmarks (process CPU, ports)."""

from __future__ import annotations

import socket

import psutil


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
