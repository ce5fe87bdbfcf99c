"""The pace a client renders at, as it asks for it over HTTP: one header, or the
`stream_options.max_tokens_per_second` field. Shared by the gateway and `tokenpipe local`."""

from __future__ import annotations

from collections.abc import Mapping

from tokenpipe.control.flowgate import FlowGate
from tokenpipe.errors import GatewayError

PACE_HEADER = "x-tokenpipe-max-tokens-per-second"


def pace_gate(headers: Mapping[str, str], option: float | None) -> FlowGate | None:
    """A flow gate paced to the asked rate (the header wins over the field); None: no pace."""
    rate = option
    header = headers.get(PACE_HEADER)
    if header is not None:
        try:
            rate = float(header)
        except ValueError:
            raise GatewayError(
                400,
                f"{PACE_HEADER} must be a number of tokens per second.",
                param=PACE_HEADER,
                code="invalid_request",
            ) from None
    if not rate or rate <= 0:
        return None
    gate = FlowGate()
    gate.set_rate(rate)
    return gate
