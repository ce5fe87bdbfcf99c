"""What the sim is told to do: its server config, and each request's timing and fault.

A request's timing starts from the configured default, takes a fault drawn by the rated-fault
dice, then any `x-sim-*` header or `[[sim ...]]` directive in the prompt (directives win).
Besides timing, `tool=NAME` (`x-sim-tool`) makes a Messages answer call a tool.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tokenpipe.engines.sim import faults
from tokenpipe.engines.sim.faults import Fault

_DIRECTIVE = re.compile(r"\[\[sim ([^\]]*)\]\]")

#: Most output tokens one request may ask for (`max_tokens` and its aliases, `output_tokens`):
#: the largest output window of today's models. The answer's words are drawn before it
#: starts, at ~0.4 us each with the event loop held: unbounded, a client's max_tokens of
#: 5,000,000 held every other request for 2 s (and 10^9 would take the host's memory).
#: Past it: a 400.
MAX_OUTPUT_TOKENS = 131_072
#: Longest delay a request may set (`ttft_ms`, `itl_ms`), in ms: an hour. Past it, or not a
#: finite number >= 0: a 400.
MAX_DELAY_MS = 3_600_000.0


def output_tokens(value: object, name: str = "max_tokens") -> int:
    """A client's output length as the sim takes it: an integer (not a bool) in
    0..MAX_OUTPUT_TOKENS, else ValueError naming `name`."""
    if type(value) is not int or not 0 <= value <= MAX_OUTPUT_TOKENS:
        raise ValueError(f"{name} must be an integer from 0 to {MAX_OUTPUT_TOKENS}")
    return value


def _delay_ms(text: str, name: str) -> float:
    try:
        ms = float(text)
    except ValueError:
        ms = -1.0
    if not 0.0 <= ms <= MAX_DELAY_MS:  # (NaN fails this too)
        raise ValueError(f"{name} must be a number of ms from 0 to {MAX_DELAY_MS:.0f}")
    return ms


@dataclass(slots=True)
class Timing:
    ttft_ms: float = 50.0
    itl_ms: float = 5.0
    tokens_per_chunk: int = 1
    #: Output length when the request gives no max_tokens.
    output_tokens: int = 64
    #: Fixed output length that overrides max_tokens (set per request, for tests).
    force_output_tokens: int | None = None
    fault: Fault | None = None
    #: Messages with `tools`: answer with a tool_use block calling this tool ("*": the
    #: request's first tool); None: answer with text.
    tool: str | None = None


@dataclass(slots=True)
class SimConfig:
    seed: int = 0
    timing: Timing = field(default_factory=Timing)
    models: list[str] = field(default_factory=lambda: ["sim-model"])
    #: Accept any model name (else unknown models get 404).
    any_model: bool = True
    rpm: float | None = None
    tpm: float | None = None
    #: Depth of the RPM/TPM buckets in seconds of refill (60: a full minute's allowance).
    bucket_seconds: float = 60.0
    rated_faults: list[tuple[Fault, float]] = field(default_factory=list)
    #: Requests answering at once past which a new one is refused with 503 (529 on
    #: Messages): an upstream with this many slots that refuses rather than queues. None:
    #: no cap.
    max_active: int | None = None
    #: Serve /v1/responses (off: a 404 there, like the many servers without that API).
    responses: bool = True


def request_timing(
    base: Timing, drawn: Fault | None, headers: Mapping[str, str], prompt_text: str
) -> Timing:
    """`base` with the drawn fault and the request's overrides. Raises ValueError on a bad one
    (its message names the override and what it may be)."""
    t = replace(base)
    if drawn is not None:
        t.fault = drawn
    pairs: dict[str, str] = {}
    for name, value in headers.items():
        lname = name.lower()
        if lname.startswith("x-sim-"):
            pairs[lname[6:].replace("-", "_")] = value
    for m in _DIRECTIVE.finditer(prompt_text):
        for item in m.group(1).split():
            k, _, v = item.partition("=")
            pairs[k.replace("-", "_")] = v
    for k, v in pairs.items():
        if k == "ttft_ms":
            t.ttft_ms = _delay_ms(v, "ttft_ms")
        elif k == "itl_ms":
            t.itl_ms = _delay_ms(v, "itl_ms")
        elif k == "tokens_per_chunk":
            t.tokens_per_chunk = max(1, int(v))
        elif k == "output_tokens":
            t.force_output_tokens = output_tokens(max(0, int(v)), "output_tokens")
        elif k == "fault":
            t.fault = None if v in ("", "none") else faults.parse(v)
        elif k == "tool":
            t.tool = None if v in ("", "none") else v
    return t
