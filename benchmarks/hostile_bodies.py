"""What one client's costly request bodies do to another client's requests: the victim's
latency alone, then while an attacker with its own valid key sends 4 MiB bodies of `[]` at a
fixed rate, for this tree and, with `--base-src`, another checkout's, side by side.

    python benchmarks/hostile_bodies.py                            # ~1 min
    python benchmarks/hostile_bodies.py --base-src ../base/src     # before/after, ~2 min

Each gateway (keys `victim` and `attacker`, one sim as its upstream) is started fresh per
round. The victim sends one-token chat requests one at a time (`--seconds` alone, then as
long under attack). The attacker runs in a process of its own and sends `--rate` bodies a
second, each a chat request for a model no upstream serves plus an unread field of 1.4 M `[]`
(4 MiB). Parsed, the body is a 404 and the sim never sees it, so what the victim waits for
is the gateway's event loop alone. A body refused before its parse (429: the key's share of
the loop, `server.max_parse_share_per_key`) costs the gateway little. The table gives the
victim's latency, the attacker's bodies by answer, and the gateway's CPU under attack;
medians of the rounds. JSON in results/hostile_bodies.json.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

import orjson
from _attack import add_args, measure, medians
from _common import ROOT, gateway, write_json

from tokenpipe.bench import procs

KEYS = {"victim": "sk-victim", "attacker": "sk-attacker"}
#: The attacker's body: 4 MiB, 1.4 M empty arrays in a field the gateway does not read.
JUNK = (
    b'{"model":"nobody-serves-this","max_tokens":1,"messages":[{"role":"user","content":"hi"}],'
    b'"x":[' + b",".join([b"[]"] * 1_390_000) + b"]}"
)
SMALL = orjson.dumps(
    {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
)


def _config(path: Path) -> Path:
    keys = "".join(
        f"    - {{name: {name}, sha256: {hashlib.sha256(key.encode()).hexdigest()}}}\n"
        for name, key in KEYS.items()
    )
    path.write_text(f"auth:\n  api_keys:\n{keys}")
    return path


def _headers(key: str) -> dict[str, str]:
    return {"content-type": "application/json", "authorization": f"Bearer {key}"}


def _outcome(status: int, body: bytes) -> str:
    return {404: "parsed", 429: "refused"}.get(status, "other")


def _round(sim_url: str, src: str | None, args: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(ROOT / ".cache" / "hostile-bodies.yaml")
    with gateway(sim_url, config=cfg, src=src) as gw:
        url = gw.url + "/v1/chat/completions"
        victim = (url, SMALL, _headers(KEYS["victim"]))
        figures, got = measure(
            gw.pid, victim, (url, JUNK, _headers(KEYS["attacker"])), _outcome, args
        )
    return {**figures, **{k: got.get(k, 0) for k in ("parsed", "refused", "other")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_args(p, 8.0, "bodies", "hostile_bodies")
    args = p.parse_args()
    targets: dict[str, str | None] = {"this tree": None}
    if args.base_src:
        targets["base"] = args.base_src
    rounds: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
    with procs.sim("--ttft-ms", "0") as sim:
        for i in range(args.rounds):
            for target, src in targets.items():
                print(f"  round {i + 1}/{args.rounds}: {target}", flush=True)
                rounds[target].append(_round(sim.url, src, args))
    rows = medians(rounds)
    print(f"\nvictim: one-token requests one at a time; attacker: {args.rate:g} bodies/s of 4 MiB")
    print(
        f"{'target':<10}{'alone p50':>10}{'p99':>7}{'attacked p50':>13}{'p99':>8}{'max':>8}"
        f"{'parsed':>8}{'429':>6}{'CPU s':>7}"
    )
    for med in rows:
        print(
            f"{med['target']:<10}{med['alone_p50']:>10.2f}{med['alone_p99']:>7.2f}"
            f"{med['attacked_p50']:>13.2f}{med['attacked_p99']:>8.1f}{med['attacked_max']:>8.0f}"
            f"{med['parsed']:>8.0f}{med['refused']:>6.0f}{med['cpu_s']:>7.2f}"
        )
    print("(ms; parsed: the attacker's bodies answered 404 after their parse)")
    write_json(args.json, "hostile_bodies", args, rows=rows)


if __name__ == "__main__":
    main()
