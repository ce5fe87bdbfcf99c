"""An upstream's `usage` object, checked where it is read: a hostile or broken upstream may
send any JSON there, and its counts feed metrics, the limiter's token bucket, the per-key
quota and the context estimator.

A count is kept only if it is a plain int (not a bool, not a float, not a string) in
[0, MAX_COUNT]; any other value is treated as absent, with one log line naming the field
(never the value's text beyond a short repr). Only the counting fields are checked; the rest
of the object (e.g. `*_tokens_details`) is passed on as it is and never read as a count.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenpipe.log_budget import LogBudget

log = logging.getLogger("tokenpipe.usage")

#: The count fields read by the gateway.
COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")
#: Largest count believed (tokens): far above any model's window (10^7), below where
#: arithmetic on it could matter for floats (2^53).
MAX_COUNT = 10_000_000


def count(value: object) -> int:
    """One count as the gateway reads it: the value if a plain int in 0..MAX_COUNT, else 0
    (for arithmetic on an upstream's numbers before `clean` sees them, e.g. a translation)."""
    return value if type(value) is int and 0 <= value <= MAX_COUNT else 0


def clean(usage: object, upstream: str = "?") -> dict[str, Any] | None:
    """`usage` with every bad count dropped; None when it is not an object or holds no count."""
    # A dict is asked for first: an ABC's isinstance costs ~700 machine instructions.
    if type(usage) is dict:
        # The usual object, every count there and good: itself, not a copy with each field
        # looked at in a loop (~35 bytecodes, not ~115, a request).
        p, c, t = (
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
            usage.get("total_tokens"),
        )
        if (
            type(p) is int
            and type(c) is int
            and type(t) is int
            and 0 <= p <= MAX_COUNT
            and 0 <= c <= MAX_COUNT
            and 0 <= t <= MAX_COUNT
        ):
            return usage
    elif not isinstance(usage, Mapping):
        return None
    if not usage:
        return None
    out = dict(usage)
    counted = False
    for name in COUNTS:
        if name not in out:
            continue
        value = out[name]
        if type(value) is int and 0 <= value <= MAX_COUNT:
            counted = True
        elif value is None:
            del out[name]
        else:
            del out[name]
            _warn(upstream, name, value)
    return out if counted else None


#: One log line a minute per upstream and field; the lines between are counted into the
#: next (an upstream that always sends a bad count wrote a line per request: 2,000 requests,
#: 440 KB). Bound: the upstreams' names (config) times COUNTS.
_budget = LogBudget(log)


def _warn(upstream: str, name: str, value: object) -> None:
    _budget.warning(
        (upstream, name),
        "upstream %s sent usage.%s = %.40r (not a count in 0..%d): ignored",
        upstream,
        name,
        value,
        MAX_COUNT,
    )
