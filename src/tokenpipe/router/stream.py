"""A stream's reader, as the relay runs it: the race for the first token, then the body under
the stall deadline, then (after a cut) a continuation, until the stream ends."""

from __future__ import annotations

from tokenpipe import sse
from tokenpipe.errors import GatewayError
from tokenpipe.relay.buffer import Accumulator
from tokenpipe.relay.events import EventParser, Record
from tokenpipe.relay.stall import StallWatch
from tokenpipe.relay.stream import Reader, read_body
from tokenpipe.router.race import first_content
from tokenpipe.router.resume import resume
from tokenpipe.router.route import Route
from tokenpipe.upstream.errors import UpstreamError, UpstreamProtocolError
from tokenpipe.upstream.http import PROTOCOL_ERROR


def reader(route: Route, parser: EventParser) -> Reader:
    """The reader of `route`'s stream for `relay.relay_stream`."""
    if route.recorded:
        parser.record = Record()

    async def read(acc: Accumulator) -> GatewayError | None:
        tally = parser.tally
        while True:
            error = await _read_one(route, parser, acc)
            # Broken bytes are not continued: the same upstream would be asked again, and
            # what the broken event held is unknown.
            if error is None or tally.finished or error.code == PROTOCOL_ERROR:
                return error
            resumed = await resume(route, error, parser, acc)
            if resumed is None:
                return error

    return read


async def _read_one(route: Route, parser: EventParser, acc: Accumulator) -> GatewayError | None:
    """Reads the route's response to its end; returns why it ended early, if it did (a hedge
    or retry may have taken over before content: `route.uresp` is the one read last)."""
    try:
        if not route.raced:
            route.raced = True
            await first_content(route, parser, acc)
        if not parser.ended:  # (a short answer may have ended with its first read)
            now = route.policy.clock.now
            watch = StallWatch(now, route.read_deadline, route.gap, acc.task)
            await read_body(route.uresp, parser, acc, watch)
        if not parser.ended:
            route.span.mark("cut")
            return GatewayError(
                502, "the upstream ended the stream early", code="upstream_stream_truncated"
            )
        # [DONE] (or the upstream's error event) ends the stream: whatever the upstream sends
        # after it is not waited for. Its connection goes back to the pool once the body ends.
        route.uresp.close(answered=True)
    except GatewayError as e:  # no first token from any attempt
        return e
    except (sse.SSEProtocolError, UpstreamProtocolError) as e:
        route.span.mark("broken")
        route.uresp.close()
        return GatewayError(502, str(e), code=PROTOCOL_ERROR)
    except TimeoutError:  # names the bound hit: stall, read timeout or the scope
        return route.stall_error()
    except UpstreamError:  # the upstream's connection broke mid-stream
        if acc.write_error is not None:
            raise  # the client's side broke first: the writer reports that
        route.span.mark("cut")
        return GatewayError(502, "the upstream connection broke", code="upstream_stream_truncated")
    return None
