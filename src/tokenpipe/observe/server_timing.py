"""W3C `Server-Timing` for one request: where the gateway's own time went (docs/observability.md).

A fixed set of names, each a duration in ms (3 decimals), nothing else: no upstream name, no
key, no text. The phases, in the order they run (all on the pipeline's perf_counter clock but
`queue` and `upstream_headers`, which are read on the router's clock):

    edge              arrival -> the pipeline has the parsed request (auth, body read, parse)
    admission         the key's quota (`control/admission`)
    context           context budgeting (its summary call included) and the API choice
    queue             -> the send of the attempt that answered: the limiter wait (and, for a
                      retried request, the attempts before it)
    upstream_headers  that send -> the upstream's response headers
    upstream_queue,   the upstream engine's own phases when it reports them
    prefill, decode   (`x-tokenpipe-queue-ms`, `-prefill-ms`, `-decode-ms`: `tokenpipe local`)
    total             arrival -> the answer (unary answers and errors)

A stream's headers carry the phases up to `upstream_headers`; its end carries the rest as an
SSE comment in the format the bench already reads (`: tokenpipe NAME_ms=VALUE ...`, before the
stream's last event): `first_token` (arrival -> first content token written), `max_gap` (the
longest wait between two content events) and `total`.

Cost: one small object per request, a few float stores, and one string per answer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

#: Every name the header may hold, in its order.
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
#: The names of the end-of-stream comment (each as NAME_ms).
STREAM_END_NAMES = ("first_token", "max_gap", "total")
#: The upstream engine's phase headers (ms) -> their Server-Timing names.
ENGINE_HEADERS = (
    ("x-tokenpipe-queue-ms", "upstream_queue"),
    ("x-tokenpipe-prefill-ms", "prefill"),
    ("x-tokenpipe-decode-ms", "decode"),
)
#: An engine's value past this many ms (a day) is not a duration: dropped.
_ENGINE_MAX_MS = 86_400_000.0


def _ms(seconds: float) -> str:
    return f"{max(0.0, seconds) * 1000.0:.3f}"


#: The header when every phase up to the upstream's headers ran (the usual case: one format).
_RAN = (
    "edge;dur=%.3f, admission;dur=%.3f, context;dur=%.3f, queue;dur=%.3f, upstream_headers;dur=%.3f"
)


class Timing:
    """The marks of one request. A mark of 0.0 is a phase that did not run (or not yet)."""

    __slots__ = ("admitted", "opened", "prepared", "queue", "started", "upstream_headers")

    def __init__(self, started: float) -> None:
        self.started = started  # perf_counter at arrival
        self.opened = 0.0  # the pipeline took the request (end of edge)
        self.admitted = 0.0  # end of admission
        self.prepared = 0.0  # end of context budgeting
        self.queue = -1.0  # seconds (router clock), once the route opened (after the above)
        self.upstream_headers = -1.0

    def header(self, end: float = 0.0, engine: Mapping[str, str] | None = None) -> str:
        """The header's value: the phases that ran, the engine's (from its response headers)
        and `total` up to `end` (0: none, a stream whose end is not known yet)."""
        started = self.started
        if self.queue >= 0.0:  # the route opened: every phase before it ran
            opened, admitted = self.opened, self.admitted
            value = _RAN % (
                (opened - started) * 1000.0,
                (admitted - opened) * 1000.0,
                (self.prepared - admitted) * 1000.0,
                self.queue * 1000.0,
                self.upstream_headers * 1000.0,
            )
        else:
            value = self._partial()
        if engine is not None:
            for header, name in ENGINE_HEADERS:
                raw = engine.get(header)
                if raw is not None:
                    ms = _engine_ms(raw)
                    if ms is not None:
                        value += f", {name};dur={ms:.3f}" if value else f"{name};dur={ms:.3f}"
        if end:
            total = "total;dur=" + _ms(end - started)
            value = f"{value}, {total}" if value else total
        return value

    def _partial(self) -> str:
        """The phases of a request that stopped before its route opened (an error)."""
        out = []
        if self.opened:
            out.append("edge;dur=" + _ms(self.opened - self.started))
            if self.admitted:
                out.append("admission;dur=" + _ms(self.admitted - self.opened))
                if self.prepared:
                    out.append("context;dur=" + _ms(self.prepared - self.admitted))
        return ", ".join(out)

    def stream_end(self, first_token_at: float | None, max_gap: float, end: float) -> bytes:
        """The end-of-stream SSE comment (one event, ends with a blank line)."""
        total = (end - self.started) * 1000.0
        if first_token_at is None:
            return b": tokenpipe max_gap_ms=%.3f total_ms=%.3f\n\n" % (max_gap * 1000.0, total)
        first = (first_token_at - self.started) * 1000.0
        return b": tokenpipe first_token_ms=%.3f max_gap_ms=%.3f total_ms=%.3f\n\n" % (
            first,
            max_gap * 1000.0,
            total,
        )


def _engine_ms(value: str) -> float | None:
    """An upstream's value, only when it is a plausible duration (it is not ours to trust)."""
    if len(value) > 32:
        return None
    try:
        ms = float(value)
    except ValueError:
        return None
    if not math.isfinite(ms) or ms < 0.0 or ms > _ENGINE_MAX_MS:
        return None
    return ms
