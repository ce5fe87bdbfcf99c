"""What a cold burst's new upstream connections cost in name lookups: N connections opened
together, each asking `getaddrinfo` as the upstream client used to, against the shared
lookup of `upstream/resolve.py` (one query for all of them), side by side in one run.

    python benchmarks/resolve.py                         # pypi.org, 10 / 100 / 1,000 at once
    python benchmarks/resolve.py --host api.openai.com --counts 100 1000

A real name is asked of the machine's resolver (it needs one that answers). Each case is
bounded by `--cap` seconds; one that does not finish is shown as more than the cap, with how
many lookups finished. JSON in results/resolve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from collections.abc import Sequence
from typing import Any

from _common import ROOT, write_json

from tokenpipe.serving import install_uvloop
from tokenpipe.upstream.resolve import Resolver


async def _each(host: str, n: int, cap: float) -> tuple[float | None, int]:
    """n getaddrinfo calls at once: seconds until all answered (None past the cap), done."""
    loop = asyncio.get_running_loop()
    tasks = [
        asyncio.ensure_future(
            loop.getaddrinfo(host, 443, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        )
        for _ in range(n)
    ]
    return await _timed(tasks, cap)


async def _shared(host: str, n: int, cap: float) -> tuple[float | None, int]:
    r = Resolver(host, 443)
    return await _timed([asyncio.ensure_future(r.addresses()) for _ in range(n)], cap)


async def _timed(tasks: Sequence[asyncio.Future[Any]], cap: float) -> tuple[float | None, int]:
    t0 = time.perf_counter()
    done, pending = await asyncio.wait(tasks, timeout=cap)
    for t in pending:
        t.cancel()
    ok = sum(1 for t in done if t.exception() is None)
    return (time.perf_counter() - t0 if not pending else None), ok


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for n in args.counts:
        # The shared lookup first: lookups cancelled at the cap still hold libuv's 4 threads
        # until the resolver answers or times out, and would queue the next case behind them.
        for name, run in (("shared lookup", _shared), ("getaddrinfo each", _each)):
            seconds, ok = await run(args.host, n, args.cap)
            rows.append({"connections": n, "target": name, "seconds": seconds, "answered": ok})
            shown = f">{args.cap:g} s" if seconds is None else f"{seconds * 1e3:.1f} ms"
            print(f"  {n:5d} at once  {name:17s} {shown:>12s}  {ok} answered", flush=True)
            await asyncio.sleep(5.0)  # the resolver's own rate limit recovers between cases
    return {"rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--host", default="pypi.org")
    p.add_argument("--counts", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--cap", type=float, default=30.0, help="seconds per case at most")
    p.add_argument("--json", default=str(ROOT / "results" / "resolve.json"))
    args = p.parse_args()
    install_uvloop()
    print(f"name lookups for {args.host}: time until every connection has its addresses")
    result = asyncio.run(_bench(args))
    write_json(args.json, "resolve", args, **result)


if __name__ == "__main__":
    main()
