"""What a new upstream connection costs the gateway: N connections opened at once, as a cold
burst opens one per stream, by the upstream client (`upstream/h1.py`'s Pool: the event loop
connects the address itself) against the way it used to (a socket of our own, options set,
`sock_connect`, then `create_connection(sock=)`), rounds interleaved in one run.

    python benchmarks/connect.py                       # 1,000 at once, 7 rounds (~10 s)
    python benchmarks/connect.py --connections 200 --rounds 15
    python benchmarks/connect.py --syscalls         # + system calls per connection (strace)

The listener runs in a child process, so the CPU counted (user + system of this process over
the opening, per connection) is the connecting side's alone, as in the gateway. `--syscalls`
adds one more round per target under `strace -c` (this process, not its threads): system
calls per connection by name, counts only (strace slows what it traces). JSON in
results/connect.json.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing
import os
import resource
import socket
import statistics
import textwrap
from collections.abc import Awaitable, Callable
from typing import Any

from _common import ROOT, strace_counts, write_json
from yarl import URL

from tokenpipe.serving import install_uvloop
from tokenpipe.upstream import h1
from tokenpipe.upstream.connection import Connection


def _listen(port: multiprocessing.SimpleQueue[int]) -> None:
    """The child: accepts and holds connections until it is terminated."""
    install_uvloop()

    async def serve() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0, backlog=8192)
        port.put(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(serve())


async def _own_socket(pool: h1.Pool) -> Connection:
    """`Pool._connect` as it was before (its error handling left out): the same timeout and
    lookup, then a socket of its own through `sock_connect` and `create_connection(sock=)`."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(pool.connect_timeout):
        family, type_, proto, _, addr = (await pool.resolver.addresses())[0]
        sock = socket.socket(family, type_, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, pool.receive_buffer_bytes)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        await loop.sock_connect(sock, addr)
        _, conn = await loop.create_connection(functools.partial(Connection, pool), sock=sock)
        pool._members.add(conn)
        return conn


def _cpu() -> float:
    """This process's CPU seconds alone (_common.cpu_seconds would add the listener child's)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _round(n: int, connect: Callable[[], Awaitable[Connection]]) -> float:
    """CPU microseconds per connection of `n` opened at once (then closed)."""
    t0 = _cpu()
    conns = await asyncio.gather(*(connect() for _ in range(n)))
    us = (_cpu() - t0) / n * 1e6
    for c in conns:
        assert c.transport is not None
        c.transport.close()
    await asyncio.sleep(0.2)  # the closes go out before the next round
    return us


async def _bench(args: argparse.Namespace, port: int) -> dict[str, Any]:
    pool = h1.Pool(
        URL(f"http://127.0.0.1:{port}"),
        limit=args.connections,
        connect_timeout=10.0,
        receive_buffer_bytes=256 * 1024,  # the upstream setting's default
    )
    targets: dict[str, Callable[[], Awaitable[Connection]]] = {
        "event loop connects (now)": pool._connect,
        "own socket (before)": lambda: _own_socket(pool),
    }
    us: dict[str, list[float]] = {name: [] for name in targets}
    await _round(50, pool._connect)  # warm-up
    for r in range(args.rounds):
        for name, connect in targets.items():
            us[name].append(await _round(args.connections, connect))
        print(f"  round {r + 1}: " + ", ".join(f"{n} {v[-1]:.0f} us" for n, v in us.items()))
    before = statistics.median(us["own socket (before)"])
    print(f"\n{args.connections} connections at once, CPU of the connecting side")
    print(f"{'target':<28} {'us/connection':>13} {'rounds':>13} {'x before':>8}")
    rows = []
    for name, v in us.items():
        med = statistics.median(v)
        span = f"{min(v):.0f}-{max(v):.0f}"
        print(f"{name:<28} {med:13.1f} {span:>13} {med / before:8.2f}")
        rows.append({"target": name, "us_per_connection": med, "rounds": v})
    diffs = sorted(b - a for a, b in zip(*us.values(), strict=True))
    saved = statistics.median(diffs)
    print(
        f"saved per connection, median of per-round differences: {saved:.1f} us "
        f"(rounds {diffs[0]:.0f} to {diffs[-1]:.0f})"
    )
    result: dict[str, Any] = {
        "rows": rows,
        "saved_us_per_connection": saved,
        "paired_differences": diffs,
    }
    if args.syscalls:
        result["syscalls_per_connection"] = await _syscalls(args.connections, targets)
    pool.close()
    return result


async def _syscalls(
    n: int, targets: dict[str, Callable[[], Awaitable[Connection]]]
) -> dict[str, dict[str, float]]:
    """System calls per connection by name, for each target, under strace -c."""
    per: dict[str, dict[str, float]] = {}
    for name, connect in targets.items():
        async with strace_counts(os.getpid(), follow=False) as counts:
            await _round(n, connect)
        per[name] = {k: v / n for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}
    print(f"\nsystem calls per connection ({n} at once, strace -c)")
    for name, calls in per.items():
        top = ", ".join(f"{k} {v:.1f}" for k, v in calls.items() if v >= 0.5)
        print(f"{name}: {sum(calls.values()):.1f}")
        print(textwrap.fill(top, 78, initial_indent="  ", subsequent_indent="  "))
    return per


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--syscalls", action="store_true", help="+ system calls per connection")
    p.add_argument("--json", default=str(ROOT / "results" / "connect.json"))
    args = p.parse_args()
    q: multiprocessing.SimpleQueue[int] = multiprocessing.SimpleQueue()
    child = multiprocessing.Process(target=_listen, args=(q,), daemon=True)
    child.start()
    try:
        port = q.get()
        install_uvloop()
        result = asyncio.run(_bench(args, port))
    finally:
        child.terminate()
    write_json(args.json, "connect", args, **result)


if __name__ == "__main__":
    main()
