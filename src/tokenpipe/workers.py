"""`tokenpipe serve --workers N`: N gateway processes on one port (SO_REUSEPORT).

The kernel spreads new connections over the processes. Limits stay whole: with the Redis
backend all processes share the buckets; with the memory backend each process enforces
1/N of every limit (`limits.workers`). The parent only holds the port, starts the workers,
passes SIGTERM and SIGINT on as they came (each worker drains on its own) and exits when they have.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
from types import FrameType

import msgspec

from tokenpipe.settings import Settings

#: Pending connections per worker before the kernel refuses new ones.
BACKLOG = 2048


def reuseport_socket(host: str, port: int, listen: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(BACKLOG)
        sock.setblocking(False)
    return sock


def _worker(encoded: bytes, port: int, log_level: str) -> None:
    early: list[int] = []  # a Ctrl-C while the modules load (~0.5 s), kept for later
    signal.signal(signal.SIGINT, lambda signum, frame: early.append(signum))
    from tokenpipe import gateway, serving
    from tokenpipe.observe import logs

    # The parent's `--log-format` reaches spawned workers through the environment.
    logs.configure(log_level, os.environ.get(logs.FORMAT_ENV, "text"))
    cfg = msgspec.json.decode(encoded, type=Settings)
    serving.hold_interrupt(lambda: bool(early))  # Ctrl-C while starting: stop once started
    sock = reuseport_socket(cfg.server.host, port, listen=True)
    serving.run(gateway.run(cfg, sock=sock))


def run(cfg: Settings, workers: int, log_level: str = "info") -> None:
    """Runs `workers` gateway processes until SIGTERM/SIGINT; returns when all have exited."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise SystemExit("tokenpipe: --workers needs SO_REUSEPORT (Linux, BSD, macOS).")
    cfg.limits.workers = workers
    # Bound but not listening: reserves the port (and resolves port 0) without taking
    # connections, which go only to listening sockets of the group.
    holder = reuseport_socket(cfg.server.host, cfg.server.port, listen=False)
    port = holder.getsockname()[1]
    cfg.server.port = port
    encoded = msgspec.json.encode(cfg)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(encoded, port, log_level), name=f"worker-{i}")
        for i in range(workers)
    ]
    for p in procs:
        p.start()

    def forward(signum: int, frame: FrameType | None) -> None:
        # The signal as it came: on SIGTERM each worker drains within the grace (a probe
        # may be watching); on Ctrl-C it lets its open streams finish without the grace.
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        for p in procs:
            p.join()
    finally:
        holder.close()
    failed = [p.exitcode for p in procs if p.exitcode not in (0, -signal.SIGTERM)]
    if failed:
        sys.exit(1)
