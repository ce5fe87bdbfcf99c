"""The server's own phases inside the doctor's waterfall: a tokenpipe gateway's Server-Timing
(and the upstream engine's phases) drawn where they ran, so that one run splits a slow first
token into network, gateway (its queue and the rest) and upstream (its queue and model time).

The gateway's phases start where the client finished sending the request and follow one
another (edge, admission, context, queue, upstream headers), then the wait for the first token
the gateway relayed. The engine's phases start where the gateway sent the request upstream.
What the client waited beyond the gateway's own first token is network (both ways) and the
client itself.
"""

from __future__ import annotations

from typing import NamedTuple

#: Client phases before the request was written (keys of `phases_ms`).
_BEFORE = ("dns", "connect", "tls", "request_sent")


class Spec(NamedTuple):
    key: str  # in phases_ms
    label: str  # the waterfall's row
    color: str
    explain: str


#: The gateway's phases in the order they run (observe/server_timing.py names them).
GATEWAY = (
    Spec("server_edge", "gateway edge", "#a78bfa", "gateway: auth, reading and parsing the body"),
    Spec("server_admission", "gateway admission", "#f59e0b", "gateway: the key's quota"),
    Spec(
        "server_context",
        "gateway context",
        "#14b8a6",
        "gateway: context budgeting (a summary call, if any)",
    ),
    Spec(
        "server_limiter_wait",
        "gateway queue",
        "#db2777",
        "gateway: waiting for upstream capacity (limiter; earlier attempts of a retry)",
    ),
    Spec(
        "server_upstream_headers",
        "upstream headers",
        "#fb923c",
        "gateway sent the request -> the upstream's response headers",
    ),
)
#: Derived: the gateway's first token less its phases above (the upstream's time to it).
UPSTREAM_FIRST = Spec(
    "server_upstream_first_token",
    "upstream first token",
    "#854d0e",
    "upstream's headers -> the first token the gateway relayed (upstream queue + prefill)",
)
#: The upstream engine's own phases (`tokenpipe local`), from where the request was sent.
ENGINE = (
    Spec("server_queue", "engine queue", "#be123c", "the upstream engine's own queue"),
    Spec("server_prefill", "engine prefill", "#65a30d", "the engine's prefill (the prompt)"),
    Spec("server_decode", "engine decode", "#1e3a8a", "the engine's decode (the output)"),
)
#: What the other server_* keys are (listed in the table, not drawn).
EXPLAIN = {s.key: s.explain for s in (*GATEWAY, UPSTREAM_FIRST, *ENGINE)} | {
    "server_first_token": "gateway: arrival -> first content token written (its TTFT)",
    "server_max_gap": "gateway: the longest gap between content events it wrote",
    "server_total": "gateway: arrival -> end of the answer",
}


class Row(NamedTuple):
    spec: Spec
    start: float  # ms since the request started, on the client's clock
    end: float


def derive(ph: dict[str, float]) -> dict[str, float]:
    """`ph` with `server_upstream_first_token` after `server_upstream_headers`, where the
    gateway said both its first token and the phases before it."""
    first = ph.get("server_first_token")
    if first is None or "server_upstream_headers" not in ph:
        return ph
    out = {}
    for k, v in ph.items():
        out[k] = v
        if k == "server_upstream_headers":
            out[UPSTREAM_FIRST.key] = round(max(0.0, first - gateway_ms(ph)), 3)
    return out


def gateway_ms(ph: dict[str, float]) -> float:
    """The gateway's phases up to the upstream's headers (ms)."""
    return sum(ph.get(s.key, 0.0) for s in GATEWAY)


def rows(ph: dict[str, float]) -> list[Row]:
    """The server's phases as waterfall rows, placed where they ran (see the module)."""
    at = sum(ph.get(k, 0.0) for k in _BEFORE)
    out = []
    for s in GATEWAY:
        v = ph.get(s.key)
        if v is not None:
            out.append(Row(s, at, at + v))
            at += v
    v = ph.get(UPSTREAM_FIRST.key)
    if v is not None:
        out.append(Row(UPSTREAM_FIRST, at, at + v))
    sent = at - ph.get("server_upstream_headers", 0.0)
    for s in ENGINE:
        v = ph.get(s.key)
        if v is not None:
            out.append(Row(s, sent, sent + v))
            sent += v
    return out


def ms_text(ms: float) -> str:
    """Milliseconds as a reader wants them: a tenth below 10 ms (a gateway's phases are often
    under 1 ms, which `:.0f` would print as 0), whole ones above."""
    return f"{ms:.1f}" if ms < 10 else f"{ms:.0f}"


def largest_gateway_phase(ph: dict[str, float]) -> tuple[str, float] | None:
    """(its row label, ms) of the gateway's biggest phase of its own (the upstream's headers
    are the upstream's time), None without Server-Timing."""
    seen = [(ph[s.key], s.label) for s in GATEWAY[:-1] if s.key in ph]
    if not seen:
        return None
    ms, label = max(seen)
    return label, ms


def first_token_split(ph: dict[str, float]) -> str | None:
    """The client's wait for the first token (after the request was written) in words:
    network, gateway and upstream, when the gateway reported its phases."""
    if UPSTREAM_FIRST.key not in ph:
        return None
    gateway = gateway_ms(ph) - ph.get("server_upstream_headers", 0.0)
    upstream = ph["server_upstream_headers"] + ph[UPSTREAM_FIRST.key]
    waited = ph.get("headers", 0.0) + ph.get("first_token", 0.0)
    network = max(0.0, waited - ph["server_first_token"])
    biggest = largest_gateway_phase(ph)
    text = f"network and client {ms_text(network)} ms, gateway {ms_text(gateway)} ms"
    if biggest is not None:
        text += f" (largest: {biggest[0].removeprefix('gateway ')} {ms_text(biggest[1])} ms)"
    text += f", upstream {upstream:.0f} ms"
    engine = [f"{s.label} {ph[s.key]:.0f} ms" for s in ENGINE[:2] if s.key in ph]
    if engine:
        text += f" ({', '.join(engine)})"
    return text
