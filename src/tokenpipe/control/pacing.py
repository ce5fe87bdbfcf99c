"""The pace a client renders at, as it asks for it over HTTP: one header, or the
`stream_options.max_tokens_per_second` field. Shared by the gateway and `tokenpipe local`."""

from __future__ import annotations

import math
from collections.abc import Mapping

from tokenpipe.control.flowgate import FlowGate
from tokenpipe.errors import GatewayError

#: The header that carries the pace (tokens/s) a client renders at: read by the front from the
#: client (`pace_gate`) and sent upstream by `HttpUpstream.post(pace=...)` as the number the
#: gateway vetted, never the client's header passed on. Upstreams that generate (`tokenpipe
#: local`) slow decoding to it instead of racing into buffers; others ignore it.
PACE_HEADER = "x-tokenpipe-max-tokens-per-second"
#: tokens per second; far above any renderer (a million tokens a second is no pace at all).
MAX_RATE = 1e6


def pace_gate(headers: Mapping[str, str], option: float | None) -> FlowGate | None:
    """A flow gate paced to the asked rate (the header wins over the field); None: no pace."""
    rate = option
    header = headers.get(PACE_HEADER)
    if header is not None:
        try:
            rate = float(header)
        except ValueError:
            rate = math.nan
        # inf, nan, negative and absurd rates are refused here, before the stream starts (the
        # flow gate would otherwise fail mid-stream). 0 means "no pace".
        if not 0 <= rate <= MAX_RATE:
            raise GatewayError(
                400,
                f"{PACE_HEADER} must be a number of tokens per second from 0 to {MAX_RATE:g}.",
                param=PACE_HEADER,
                code="invalid_request",
            )
    if not rate or rate <= 0:
        return None
    gate = FlowGate()
    gate.set_rate(rate)
    return gate
