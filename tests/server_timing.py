"""A strict reader of the gateway's `Server-Timing` header and its end-of-stream comment, written
from the W3C grammar, not from the gateway's code:

    Server-Timing        = #server-timing-metric
    server-timing-metric = metric-name *( OWS ";" OWS server-timing-param )
    server-timing-param  = token OWS "=" OWS ( token / quoted-string )

On top of the grammar, what the gateway promises (docs/observability.md): names from a fixed
set, in their order, each once, each with exactly one `dur` in ms with at most 3 decimals.
"""

from __future__ import annotations

import re
from typing import Any

#: The header's names, in the order the gateway writes them.
NAMES = (
    "edge",
    "admission",
    "context",
    "queue",
    "upstream_headers",
    "upstream_queue",
    "prefill",
    "decode",
    "total",
)
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_QUOTED = r'"(?:[^"\\]|\\.)*"'
_PARAM = re.compile(rf"[ \t]*;[ \t]*({_TOKEN})[ \t]*=[ \t]*({_TOKEN}|{_QUOTED})")
_METRIC = re.compile(rf"({_TOKEN})((?:[ \t]*;[ \t]*{_TOKEN}[ \t]*=[ \t]*(?:{_TOKEN}|{_QUOTED}))*)")
_MS = re.compile(r"(?:0|[1-9][0-9]*)(?:\.[0-9]{1,3})?")
_COMMENT = re.compile(r"tokenpipe (?:first_token_ms=(\S+) )?max_gap_ms=(\S+) total_ms=(\S+)")


def parse(value: str) -> dict[str, float]:
    """{name: ms}, in the header's order; AssertionError on anything the gateway must not send."""
    out: dict[str, float] = {}
    for item in value.split(","):
        item = item.strip(" \t")
        m = _METRIC.fullmatch(item)
        assert m, f"not a Server-Timing metric: {item!r} in {value!r}"
        name = m.group(1)
        assert name in NAMES, f"unknown name {name!r}"
        assert name not in out, f"{name} twice"
        params = _PARAM.findall(m.group(2))
        assert [k for k, _ in params] == ["dur"], f"{name}: params {params}"
        out[name] = _ms(params[0][1], name)
    order = [n for n in NAMES if n in out]
    assert list(out) == order, f"out of order: {list(out)}"
    return out


def stream_end(comment: bytes) -> dict[str, float]:
    """The gateway's end-of-stream comment (`tokenpipe first_token_ms=... max_gap_ms=...
    total_ms=...`, without the leading `: `) as {name: ms}."""
    m = _COMMENT.fullmatch(comment.decode())
    assert m, comment
    first, gap, total = m.groups()
    out = {"max_gap": _ms(gap, "max_gap"), "total": _ms(total, "total")}
    if first is not None:
        out["first_token"] = _ms(first, "first_token")
    return out


def _ms(text: str, name: str) -> float:
    assert _MS.fullmatch(text), f"{name}: dur {text!r} is not ms with at most 3 decimals"
    return float(text)


def timing_comment(ev: Any) -> bool:
    """True for the gateway's end-of-stream timing comment (checked strictly), False for an
    event; any other comment fails (for tests whose streams hold nothing but events)."""
    if not ev.comment:
        return False
    stream_end(ev.data)
    return True
