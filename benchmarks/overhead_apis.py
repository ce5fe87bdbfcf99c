"""overhead.py --api chat,responses,messages: what the gateway costs in each client API,
natively and translated, against the same sim in one run.

Per API, four targets: `direct` (the client against the sim speaking that API), `bare-relay`
(the byte relay: the floor), `native` (tokenpipe passing the API through to an upstream that
speaks it) and `translated` (tokenpipe translating it onto an upstream of the other API):

    API        native: the upstream is                translated: the upstream is
    chat       OpenAI (chat completions)              Anthropic (Messages)
    responses  OpenAI with `responses: native`        OpenAI chat (`responses: chat`)
    messages   Anthropic (Messages)                   OpenAI chat

Every target of every API runs in each round (the order rotated by one per round), so the
per-round differences compare targets that ran moments apart: each gateway row's TTFT against
its API's bare relay, and each API's translated row against its native one (the target:
within 1 ms at p50). CPU per request is the gateway process's (the relay's for the relay),
measured while that target alone ran. The sim answers every API with `--max-tokens` tokens
(`--output-tokens` set to it: a Messages answer is otherwise capped at the sim's default).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from _common import bare_relay, gateway, gateway_with
from _overhead import PACED_ITL_MS, Target, diffs, interval, median, ramp_seconds, row, run_rounds

from tokenpipe.bench.procs import Service

ROLES = ("direct", "bare-relay", "native", "translated")
#: API -> (the gateway that serves it natively, the one that translates it); see the docstring.
GATEWAYS = {
    "chat": ("openai", "anthropic"),
    "responses": ("responses-native", "openai"),
    "messages": ("anthropic", "openai"),
}
#: Translated must stay within this of native at p50 (issue 19).
TARGET_MS = 1.0


def _start_gateway(kind: str, sim_url: str) -> Service:
    if kind == "anthropic":
        return gateway("anthropic+" + sim_url)
    # The sim serves /v1/responses, so `responses: auto` (the default) would pass it through:
    # the OpenAI gateway is pinned to translating it to chat.
    mode = "native" if kind == "responses-native" else "chat"
    config = f"upstreams:\n  - {{name: sim, url: '{sim_url}/v1', responses: {mode}}}\n"
    return gateway_with(f"overhead-responses-{mode}", config)


async def bench_pace(pace: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (start, concurrency) table at one pace, over one sim, relay and set of gateways."""
    itl = f"{PACED_ITL_MS:g}" if pace == "paced" else "0"
    kinds = sorted({kind for api in args.api for kind in GATEWAYS[api]})
    out: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        sim = stack.enter_context(
            Service(
                "sim",
                "--port",
                "0",
                "--ttft-ms",
                str(args.ttft_ms),
                "--itl-ms",
                itl,
                "--output-tokens",
                str(args.max_tokens),
                name="sim",
            )
        )
        relay = stack.enter_context(bare_relay(sim.url))
        gateways = {k: stack.enter_context(_start_gateway(k, sim.url)) for k in kinds}
        endpoints: list[Target] = []
        for api in args.api:
            native, translated = (gateways[k] for k in GATEWAYS[api])
            for role, svc, pid in (
                ("direct", sim, None),
                ("bare-relay", relay, relay.pid),
                ("native", native, native.pid),
                ("translated", translated, translated.pid),
            ):
                endpoints.append(Target(f"{api} {role}", svc.url + "/v1", pid, api=api))
        for start in args.start:
            for concurrency in args.concurrency:
                out.append(await _table(args, pace, start, concurrency, endpoints))
    return out


async def _table(
    args: argparse.Namespace, pace: str, start: str, concurrency: int, endpoints: list[Target]
) -> dict[str, Any]:
    targets = [e.fresh() for e in endpoints]
    ramp_s = ramp_seconds(args, pace, start)
    await run_rounds(args, f"{pace} {start} c={concurrency}", targets, concurrency, ramp_s)
    rows: list[dict[str, Any]] = []
    verdicts: list[dict[str, Any]] = []
    for i, api in enumerate(args.api):
        direct, relay, native, translated = targets[4 * i : 4 * i + 4]
        for role, t in zip(ROLES, (direct, relay, native, translated), strict=True):
            r = row(t, direct, relay)
            r["api"], r["role"] = api, role
            r["cpu_ms_per_request"] = (
                t.cpu_s / t.requests * 1000 if t.pid is not None and t.requests else None
            )
            rows.append(r)
        verdicts.append(_vs_native(api, translated, native))
    _print(pace, start, concurrency, rows, verdicts)
    return {
        "pace": pace,
        "start": start,
        "concurrency": concurrency,
        "apis": list(args.api),
        "rows": rows,
        "translated_vs_native": verdicts,
    }


def _vs_native(api: str, translated: Target, native: Target) -> dict[str, Any]:
    """Translated minus native, round by round; `meets` says whether the p50 target holds:
    yes when the whole interval is within it, no when the whole interval is past it, else
    unresolved (longer or more rounds narrow the interval)."""
    d50, d99 = diffs(translated, native, 0), diffs(translated, native, 1)
    ci = interval(d50)
    meets = "unresolved"
    if ci is not None:
        meets = "yes" if ci[1] <= TARGET_MS else "no" if ci[0] > TARGET_MS else "unresolved"
    return {
        "api": api,
        "ttft_p50_ms": median(d50),
        "ttft_p50_ci95_ms": ci,
        "ttft_p99_ms": median(d99),
        "ttft_p99_ci95_ms": interval(d99),
        "target_ms": TARGET_MS,
        "meets": meets,
    }


def _num(v: float | None, width: int, digits: int = 2, sign: bool = False) -> str:
    if v is None:
        return f"{'-':>{width}}"
    return f"{v:+{width}.{digits}f}" if sign else f"{v:{width}.{digits}f}"


def _ci(label: str, m: float | None, ci: list[float] | None) -> str:
    if m is None or ci is None:
        return f"{label} -"
    return f"{label} {m:+.1f} [{ci[0]:+.1f}, {ci[1]:+.1f}]"


def _print(
    pace: str,
    start: str,
    concurrency: int,
    rows: list[dict[str, Any]],
    verdicts: list[dict[str, Any]],
) -> None:
    """The table, 80 columns wide: pooled TTFT, the median per-round difference to the bare
    relay, tokens/s (the users' own rates, summed), CPU per request, failed requests."""
    print(f"\n== {pace}, concurrency {concurrency}, {start} start ==")
    print(f"{'':20} {'TTFT ms':>17} {'vs relay ms':>17} {'':>7} {'CPU ms':>7}")
    print(
        f"{'api':<9} {'target':<10} {'p50':>8} {'p99':>8} {'p50':>8} {'p99':>8} "
        f"{'tok/s':>7} {'/req':>7} {'fail':>5}"
    )
    for r in rows:
        print(
            f"{r['api']:<9} {r['role']:<10} {_num(r['ttft_p50_ms'], 8)} "
            f"{_num(r['ttft_p99_ms'], 8)} {_num(r['vs_relay_ttft_p50_ms'], 8, sign=True)} "
            f"{_num(r['vs_relay_ttft_p99_ms'], 8, sign=True)} {_num(r['tokens_per_s'], 7, 0)} "
            f"{_num(r['cpu_ms_per_request'], 7, 3)} {r['requests_failed']:5d}"
        )
    print("vs relay: median of per-round differences [95% interval over rounds], ms")
    for r in rows:
        if r["vs_relay_ttft_p50_ci95_ms"] is not None:
            print(
                f"  {r['api']:<9} {r['role']:<10} "
                f"{_ci('p50', r['vs_relay_ttft_p50_ms'], r['vs_relay_ttft_p50_ci95_ms'])}  "
                f"{_ci('p99', r['vs_relay_ttft_p99_ms'], r['vs_relay_ttft_p99_ci95_ms'])}"
            )
    print(f"translated vs native, ms (target: p50 within {TARGET_MS:g} ms)")
    for v in verdicts:
        print(
            f"  {v['api']:<9} {_ci('p50', v['ttft_p50_ms'], v['ttft_p50_ci95_ms'])}  "
            f"{_ci('p99', v['ttft_p99_ms'], v['ttft_p99_ci95_ms'])}  meets: {v['meets']}"
        )
