"""CPU per 1-token request of the gateway with nothing else on the cores: wrk (C) as the
client and nginx (C) as the upstream, replaying the sim's own 1-token answer (`_nginx.py`),
so the figure is the gateway's own cost, as the compiled gateways' published figures are
taken against a loopback mock. The bare aiohttp relay in the same run; rounds interleaved.

    python benchmarks/request_cpu.py                     # ~1.5 min; needs wrk and nginx
    python benchmarks/request_cpu.py --rounds 7 --features-off --base-src ../base/src
    python benchmarks/request_cpu.py --nginx             # + nginx as the proxy: a compiled hop
    python benchmarks/request_cpu.py --reading-relay     # + the relay reading what it forwards
    python benchmarks/request_cpu.py --whole             # non-streamed: one JSON answer

`relay_cost.py` measures the same request with the sim and a Python load generator on the
same 2 cores. Their CPU crowds the gateway's (caches, wake-ups), so its figures are higher
and its ratios narrower; this one is the request path alone. With `--features-off`, the
gateway with every optional layer off is a target too: the request path's plumbing. With
`--nginx`, nginx as a streaming proxy (`_nginx.proxy`) is one: what a compiled hop with no
features costs here, the class of the Go and Rust gateways' figures. With `--reading-relay`,
the bare relay that also decodes the request and each event it forwards (`bare_relay.py
--read`): the least a Python hop that knows what went through it (usage, the stream's end)
can cost. With `--whole`, the requests ask for a whole answer (`"stream": false`) and nginx
replays the sim's JSON one. The table's "x relay" is the median of each round's ratio, with
their range. JSON in results/request_cpu.json.
"""

from __future__ import annotations

import argparse
import contextlib

import _nginx
import _wrk
from _common import (
    ROOT,
    bare_relay,
    features_off_config,
    gateway,
    src_dir,
    write_json,
)

from tokenpipe.bench.procs import Service


def _measure(
    svc: Service | _nginx.Nginx,
    seconds: float,
    connections: int,
    prompt_bytes: int,
    stream: bool = True,
) -> tuple[float, float]:
    """(CPU microseconds of the serving process per request, requests/s) of one wrk run."""
    url = svc.url + "/v1/chat/completions"
    cost, rate, bad = _wrk.measure(svc.pid, url, seconds, connections, prompt_bytes, stream)
    if bad:
        raise RuntimeError(f"{bad} answers were not 2xx")
    return cost, rate


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=5.0, help="wrk's run per target a round")
    p.add_argument("--connections", type=int, default=32, help="wrk's keep-alive connections")
    p.add_argument("--features-off", action="store_true", help="+ tokenpipe, layers off")
    p.add_argument("--base-src", type=src_dir, help="+ tokenpipe from another src/")
    p.add_argument("--nginx", action="store_true", help="+ nginx as the proxy (compiled)")
    p.add_argument(
        "--reading-relay", action="store_true", help="+ the relay decoding what it forwards"
    )
    p.add_argument(
        "--prompt-bytes",
        type=int,
        default=_wrk.PROMPT_BYTES,
        help="the request's one message, in bytes (default ~32 tokens)",
    )
    p.add_argument(
        "--whole", action="store_true", help="non-streamed requests and answers (one JSON body)"
    )
    p.add_argument("--json", default=str(ROOT / "results" / "request_cpu.json"))
    args = p.parse_args()
    if not _wrk.available() or _nginx.binary() is None:
        p.error("needs wrk and nginx (Debian: apt-get install wrk nginx-light)")
    with contextlib.ExitStack() as stack:
        sim = stack.enter_context(Service("sim", "--port", "0", name="sim"))
        stream = not args.whole
        answer, models = _nginx.record(sim.url, stream=stream)
        sim.stop()  # nothing of it runs beside the targets
        kind = "text/event-stream" if stream else "application/json"
        upstream = stack.enter_context(_nginx.mock_upstream(answer, models, kind))
        targets: dict[str, Service | _nginx.Nginx] = {
            "tokenpipe": stack.enter_context(gateway(upstream))
        }
        if args.features_off:
            off = gateway(upstream, config=features_off_config())
            targets["tokenpipe-off"] = stack.enter_context(off)
        if args.base_src:
            targets["tokenpipe-base"] = stack.enter_context(gateway(upstream, src=args.base_src))
        targets["bare-relay"] = stack.enter_context(bare_relay(upstream))
        if args.reading_relay:
            targets["reading-relay"] = stack.enter_context(bare_relay(upstream, read=True))
        if args.nginx:
            targets["nginx"] = stack.enter_context(_nginx.proxy(upstream))
        for svc in targets.values():  # warm-up: connections, caches, estimators
            _measure(svc, 2, args.connections, args.prompt_bytes, stream)
        us: dict[str, list[float]] = {name: [] for name in targets}
        rps: dict[str, list[float]] = {name: [] for name in targets}
        names = list(targets)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                cost, rate = _measure(
                    targets[name], args.seconds, args.connections, args.prompt_bytes, stream
                )
                us[name].append(cost)
                rps[name].append(rate)
            print(f"  round {r + 1}/{args.rounds}", flush=True)
    print(
        f"\n1-token chat requests{'' if stream else ' (whole answers)'}, "
        f"{args.prompt_bytes}-byte prompt, {len(answer)}-byte answer,"
        f" wrk {args.connections} conns"
    )
    rows = _wrk.table(us, rps, "bare-relay")
    write_json(args.json, "request_cpu", args, rows=rows)


if __name__ == "__main__":
    main()
