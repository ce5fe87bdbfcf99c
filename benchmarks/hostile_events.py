"""What one upstream's costly events do to other clients' requests: a victim's latency alone,
then while another client streams from an upstream whose events each carry a field of 4 MiB
of `[]`s, for this tree and, with `--base-src`, another checkout's, side by side.

    python benchmarks/hostile_events.py                            # ~1 min
    python benchmarks/hostile_events.py --base-src ../base/src     # before/after, ~2 min

Each gateway (two upstreams: a sim serving `sim-model`, and a junk upstream serving
`junk-model`) is started fresh per round. The victim sends one-token chat requests to the
sim one at a time (`--seconds` alone, then as long under attack). The attacker runs in a
process of its own and starts `--rate` streamed Messages requests a second for the junk
model: the gateway translates them onto the junk upstream's chat API, whose every answer is
a role chunk, one chunk of text with an unread field of 1.4 M `[]` (4 MiB), a finish chunk
and `[DONE]` (a process of this script, `_junk_upstream`). What the victim waits for is the
gateway's event loop reading those events (dialects/event_json.py). The table gives the
victim's latency (and how many of its requests took over 10 ms), the attacker's streams by
outcome, and the gateway's CPU under attack; medians of the rounds. JSON in
results/hostile_events.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
from typing import Any

import orjson
from _attack import add_args, measure, medians
from _common import ROOT, free_port, write_json
from aiohttp import web

from tokenpipe.bench import procs

SMALL = orjson.dumps(
    {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
)
ATTACK = orjson.dumps(
    {
        "model": "junk-model",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
)
_HEAD = b'data: {"id":"c","object":"chat.completion.chunk","model":"junk-model","choices":'
#: The junk upstream's answer: 4 MiB in the text chunk's unread field `x`.
ANSWER = b"".join(
    [
        _HEAD + b'[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
        _HEAD + b'[{"index":0,"delta":{"content":"hi"}}],"x":[',
        b",".join([b"[]"] * 1_390_000),
        b"]}\n\n",
        _HEAD + b'[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
)


def _junk_upstream(port: int) -> None:
    """An OpenAI-compatible upstream whose every stream is ANSWER (its own process)."""

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(ANSWER)
        await resp.write_eof()
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "junk-model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def _gateway(sim_url: str, junk_url: str, src: str | None) -> procs.Service:
    config = ROOT / ".cache" / "hostile-events.yaml"
    config.parent.mkdir(exist_ok=True)
    config.write_text(
        "upstreams:\n"
        f"  - {{name: sim, url: '{sim_url}/v1', models: [sim-model]}}\n"
        f"  - {{name: junk, url: '{junk_url}/v1', models: [junk-model]}}\n"
    )
    env = {"PYTHONPATH": src} if src else None
    return procs.gateway("--config", str(config), "--log-level", "warning", env=env)


def _outcome(status: int, body: bytes) -> str:
    return "whole" if status == 200 and b"event: message_stop" in body else "failed"


def _round(sim_url: str, junk_url: str, src: str | None, args: Any) -> dict[str, Any]:
    with _gateway(sim_url, junk_url, src) as gw:
        json = {"content-type": "application/json"}
        victim = (gw.url + "/v1/chat/completions", SMALL, json)
        attacker = (gw.url + "/v1/messages", ATTACK, json)
        figures, got = measure(gw.pid, victim, attacker, _outcome, args)
    return {
        **figures,
        "whole": got.get("whole", 0),
        "failed": sum(got.values()) - got.get("whole", 0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_args(p, 4.0, "streams", "hostile_events")
    args = p.parse_args()
    targets: dict[str, str | None] = {"this tree": None}
    if args.base_src:
        targets["base"] = args.base_src
    rounds: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
    junk_port = free_port()
    junk = multiprocessing.Process(target=_junk_upstream, args=(junk_port,), daemon=True)
    junk.start()
    try:
        with procs.sim("--ttft-ms", "0") as sim:
            for i in range(args.rounds):
                for target, src in targets.items():
                    print(f"  round {i + 1}/{args.rounds}: {target}", flush=True)
                    rounds[target].append(
                        _round(sim.url, f"http://127.0.0.1:{junk_port}", src, args)
                    )
    finally:
        junk.terminate()
    rows = medians(rounds)
    print(f"\nvictim: one-token requests one at a time; attacker: {args.rate:g} streams/s")
    print(
        f"{'target':<10}{'alone p50':>10}{'attacked p50':>13}{'p99':>8}{'max':>8}"
        f"{'>10 ms':>7}{'whole':>7}{'failed':>7}{'CPU s':>7}"
    )
    for med in rows:
        print(
            f"{med['target']:<10}{med['alone_p50']:>10.2f}"
            f"{med['attacked_p50']:>13.2f}{med['attacked_p99']:>8.1f}{med['attacked_max']:>8.0f}"
            f"{med['slow']:>7.0f}{med['whole']:>7.0f}{med['failed']:>7.0f}{med['cpu_s']:>7.2f}"
        )
    print(
        "(ms; >10 ms: the victim's requests that took longer; whole: the attacker's streams"
        " that ended with message_stop)"
    )
    write_json(args.json, "hostile_events", args, rows=rows)


if __name__ == "__main__":
    main()
