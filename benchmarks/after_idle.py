"""The first request after a quiet spell, at concurrency 1: its first token, against the warm
requests that follow it, direct to the sim and through each hop, rounds interleaved. Does a
hop keep a connection to its upstream across the spell, or open a new one on the request's
way (on loopback ~1 ms; to a real upstream a TCP and a TLS handshake, 2-3 round trips)?

    python benchmarks/after_idle.py                        # ~6 min (8 spells of 45 s)
    python benchmarks/after_idle.py --base-src ../base/src --spells 8 --quiet-s 45
    python benchmarks/after_idle.py --quiet-s 80 --upstream-host localhost   # + a lookup

Each spell: `--quiet-s` seconds with no request, then one request to each target in turn
(the order rotated every spell), then `--warm` more to each, `--gap-ms` apart. The client is
c1_anatomy.py's blocking one, one keep-alive connection per target; a connection the hop
closed while idle (tokenpipe closes a client's after 75 s) is opened again, and given 50 ms,
before the timed request, so the client's own reconnect is not timed. Hops' upstream
keep-alive: tokenpipe 30 s (`keepalive_seconds`), with its 2 most recently used connections
kept up to 300 s (`warm_connections`, `warm_seconds`; a base tree may have no warm ones);
the bare relay's aiohttp connector 15 s; the sim (aiohttp's server) keeps an idle
connection 75 s, so a spell over that is a new connection for everyone. With
`--upstream-host localhost` the hops reach the sim by name, which a new connection may have
to look up first (/etc/hosts here: a fraction of a real resolver's 1-50 ms).
JSON in results/after_idle.json.
"""

from __future__ import annotations

import argparse
import select
import statistics
import time

from _common import ROOT, bare_relay, gateway, src_dir, write_json
from c1_anatomy import Client, _body

from tokenpipe.bench.procs import Service, sim


def _ready(client: Client) -> None:
    """Reopens a connection the hop closed while idle, outside the timed request."""
    if select.select([client.sock], [], [], 0)[0]:
        client.sock.close()
        client.sock = client._connect()
        time.sleep(0.05)  # the hop accepts it now, not within the timed request


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--spells", type=int, default=8, help="quiet spells, each then measured")
    p.add_argument("--quiet-s", type=float, default=45.0, help="seconds of no request")
    p.add_argument("--warm", type=int, default=10, help="requests after the first, each")
    p.add_argument("--gap-ms", type=float, default=10.0, help="between the warm requests")
    p.add_argument("--base-src", type=src_dir, help="+ tokenpipe from another src/")
    p.add_argument("--upstream-host", default="127.0.0.1", help="the sim's host, for the hops")
    p.add_argument("--json", default=str(ROOT / "results" / "after_idle.json"))
    args = p.parse_args()
    upstream = sim("--ttft-ms", "20", "--itl-ms", "20")
    hops: dict[str, Service | None] = {"direct": None}
    try:
        named = upstream.url.replace("127.0.0.1", args.upstream_host)
        hops["tokenpipe"] = gateway(named)
        if args.base_src:
            hops["tp-base"] = gateway(named, src=args.base_src)
        hops["bare relay"] = bare_relay(named)
        body = _body(4)
        clients = {n: Client((svc or upstream).url, body) for n, svc in hops.items()}
        for c in clients.values():  # warm-up: connections, caches, the gateway's estimates
            for _ in range(30):
                c.one()
        first: dict[str, list[float]] = {n: [] for n in hops}
        warm: dict[str, list[float]] = {n: [] for n in hops}
        names = list(hops)
        for s in range(args.spells):
            time.sleep(args.quiet_s)  # the spell itself: what is measured is its end
            order = names[s % len(names) :] + names[: s % len(names)]
            for name in order:
                _ready(clients[name])
            for name in order:
                first[name].append(clients[name].one()[1] * 1e3)
            for name in order:
                for _ in range(args.warm):
                    time.sleep(args.gap_ms / 1000)  # paced by design
                    warm[name].append(clients[name].one()[1] * 1e3)
            shown = "  ".join(f"{n} {first[n][-1]:.2f}" for n in names)
            print(f"  spell {s + 1}/{args.spells}: first token ms {shown}", flush=True)
        for c in clients.values():
            c.close()
    finally:
        for svc in hops.values():
            if svc is not None:
                svc.stop()
        upstream.stop()
    rows = {}
    direct_first = statistics.median(first["direct"])
    direct_warm = statistics.median(warm["direct"])
    print(f"\nfirst token after {args.quiet_s:g} s of quiet, {args.spells} spells, medians (ms)")
    print(f"{'target':<11} {'after quiet':>11} {'added':>7} {'warm':>7} {'added':>7} {'cost':>6}")
    for name in names:
        f, w = statistics.median(first[name]), statistics.median(warm[name])
        af, aw = f - direct_first, w - direct_warm
        rows[name] = {"first_ms": f, "warm_ms": w, "added_first_ms": af, "added_warm_ms": aw}
        add = [f"{x:+.2f}" if name != "direct" else "-" for x in (af, aw, af - aw)]
        print(f"{name:<11} {f:11.2f} {add[0]:>7} {w:7.2f} {add[1]:>7} {add[2]:>6}")
    print("(cost: what quiet adds to a hop's first token, beyond what it adds warm)")
    write_json(args.json, "after_idle", args, rows=rows, first_ms=first, warm_ms=warm)


if __name__ == "__main__":
    main()
