"""Mid-stream recovery: a stream cut after content continues on a healthy upstream (the
request + the text so far, as its dialect builds it), feeding the same accumulator, so the
client sees one stream."""

from __future__ import annotations

import logging

from tokenpipe.errors import GatewayError
from tokenpipe.relay.buffer import Accumulator
from tokenpipe.relay.events import EventParser
from tokenpipe.router.attempt import until_answered
from tokenpipe.router.route import Route
from tokenpipe.upstream.h1 import UpstreamResponse
from tokenpipe.upstream.http import HttpUpstream

log = logging.getLogger("tokenpipe.tail")


async def resume(
    route: Route, error: GatewayError, parser: EventParser, acc: Accumulator
) -> UpstreamResponse | None:
    """Continues a cut stream; None when it cannot (the relay then ends the stream with an
    error event that counts what was delivered). Up to `recovery.max_continuations` per
    request, each a retry in the retry budget, all within the request's scope."""
    if route.client_expired():
        return None  # the client's own deadline cut it: not the upstream's failure
    policy, req = route.policy, route.req
    policy.unhealthy(route.upstream.name)
    text, deltas = parser.recorded()
    if not route.recorded or not deltas:
        return None
    dialect = req.dialect

    def eligible(u: HttpUpstream) -> bool:
        return dialect.continues_on(u.settings)

    a = await until_answered(
        policy,
        req,
        route.continuations,
        body=dialect.continuation(req.obj, text, deltas),
        first_token=True,
        ticket=route.side_ticket,
        avoid=route.upstream.name,
        reason="midstream",
        eligible=eligible,
    )
    if a is None:
        return None
    if not a.streaming:
        a.discard(a.resp.status if a.resp is not None else None)
        return None
    log.info(
        "request %s: stream cut after %d deltas (%s), continued on %s",
        req.request_id,
        deltas,
        error.message,
        a.upstream.name,
    )
    route.ticket.failed(error.status)
    return route.switch(a, parser, acc)
