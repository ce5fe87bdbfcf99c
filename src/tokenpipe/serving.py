"""Runs an aiohttp application (the engines, the bare relay; the gateway has its own server,
front/server.py) with uvloop, handler cancellation and a graceful drain.

Handler cancellation is on: when a client disconnects, its handler task is cancelled at once,
which closes the upstream connection (capacity is the scarcest thing a gateway holds).
On SIGTERM or SIGINT: report not-ready and keep answering (the `drain` hook: see
front/drain.py) while open requests finish, for up to `drain_seconds`; then cancel what is left,
close the listening socket and the connections, and exit.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import TextIO

from aiohttp import web

Hook = Callable[[], Awaitable[None]]


#: The collector's first-generation threshold while serving (CPython's default: 700).
GC_GEN0_THRESHOLD = 10_000


def settle_heap() -> None:
    """Once start-up is done: collect, then freeze what is left (modules, config, tokenizers,
    metric families: ~100,000 objects that live as long as the process) out of the cyclic
    collector's reach, and make young collections rarer.

    Why: a full collection walks every tracked object and stops the loop while it does, and
    every stream waiting for its next event waits that much longer. In a burst of 1,000
    streams (benchmarks/burst.py) the gateway spent 98-111 ms in the collector, 45-48 ms of
    it in two full collections of ~109,000 objects; frozen, with a threshold of 10,000, the
    full collections took 14.5 ms and the collector 64-67 ms in all. Landed, over 7 bursts
    against the tree before: TTFT p50 +121 ms over direct against +161, CPU per stream 1.13
    ms against 1.24 (docs/performance.md, "The garbage collector in a burst, landed").
    Freezing alone measured no better. The cost: cyclic garbage waits for up to 10,000 net
    allocations instead of 700 before a young collection frees it.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def announce(line: str, stream: TextIO | None = None) -> None:
    """Prints `line` to `stream` (stdout) in one write. With `serve --workers N` the
    processes share stdout and stderr, and print() writes the text and its newline apart
    (unbuffered, as tests and benchmarks run it, and always on stderr), so two workers'
    lines could interleave into one ("...:8000tokenpipe gateway listening on ...:8000\n\n").
    One write of fewer than PIPE_BUF (4,096) bytes to a pipe is atomic."""
    out = stream or sys.stdout
    out.write(line + "\n")
    out.flush()


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every POSIX platform
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def serve(
    app: web.Application,
    host: str,
    port: int,
    *,
    drain_seconds: float = 30.0,
    name: str = "tokenpipe",
    on_draining: Callable[[], None] | None = None,
    extra_start: Hook | None = None,
    extra_stop: Hook | None = None,
    sock: socket.socket | None = None,
    idle_seconds: float = 75.0,
    access_log: bool = False,
    drain: Hook | None = None,
) -> None:
    """`idle_seconds`: an idle keep-alive connection is closed after this long, and so is a new
    connection whose first request's headers have not all arrived by then (aiohttp arms its
    keep-alive timer at connect: it is the only deadline on trickled headers)."""
    from tokenpipe.observe.logs import AccessLog
    from tokenpipe.rejections import Runner

    runner = Runner(
        app,
        handler_cancellation=True,
        # After the drain hook (which ends or cuts the open requests within drain_seconds)
        # only idle connections are left: closing them must not wait drain_seconds again.
        shutdown_timeout=drain_seconds if drain is None else min(drain_seconds, 1.0),
        access_log=logging.getLogger("tokenpipe.access") if access_log else None,
        access_log_class=AccessLog,
        handle_signals=False,
        keepalive_timeout=idle_seconds,
    )
    await runner.setup()
    site: web.BaseSite
    if sock is not None:
        site = web.SockSite(runner, sock)
    else:
        site = web.TCPSite(runner, host, port, backlog=2048, reuse_address=True)
    await site.start()
    if extra_start is not None:
        await extra_start()
    bound = _bound_port(runner) or port
    announce(f"{name} listening on http://{host}:{bound}")

    try:
        await until_signalled()
    finally:
        announce(f"{name} draining (up to {drain_seconds:g} s)", sys.stderr)
        if on_draining is not None:
            on_draining()
        # Both fronts drain at the same time, each within drain_seconds.
        extra = asyncio.ensure_future(extra_stop()) if extra_stop is not None else None
        if drain is not None:
            await drain()
        await runner.cleanup()
        if extra is not None:
            await extra


#: A Ctrl-C that came while the process was starting (`hold_interrupt`); bound: one entry.
_interrupted: list[signal.Signals] = []


def hold_interrupt(came: Callable[[], bool] = lambda: False) -> None:
    """Until `until_signalled` takes over, a SIGINT is kept for it rather than raised: a
    `serve --workers` worker gets Ctrl-C from the terminal and from its parent, and one that
    is still starting stops once it has started (and drains what it has: nothing). `came`:
    one came before this was called (asked after the handler is in place)."""

    def keep(signum: int, frame: FrameType | None) -> None:
        if not _interrupted:
            _interrupted.append(signal.SIGINT)

    signal.signal(signal.SIGINT, keep)
    if came():
        keep(signal.SIGINT, None)


async def until_signalled() -> signal.Signals:
    """Returns at the first SIGTERM or SIGINT (or one held since start-up): which one."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[signal.Signals] = loop.create_future()

    def note(sig: signal.Signals) -> None:
        if not got.done():
            got.set_result(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, note, sig)
    if _interrupted:
        note(_interrupted[0])
    return await got


def _bound_port(runner: web.AppRunner) -> int | None:
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return int(addr[1])
    return None


def run(main: Awaitable[None]) -> None:
    install_uvloop()
    try:
        asyncio.run(main)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        pass
