"""Shutdown as orchestrators expect it (docs/config.md, `drain_seconds`).

After SIGTERM the gateway keeps its listening socket and its kept-alive connections, so a
load balancer sees answers, not resets: `/readyz` says 503, a new API request gets 503 with
`Retry-After`, and open requests run on. It keeps answering for at least `grace` seconds (a
readiness probe must get to see the 503) and until the open requests end, but never past
`drain_seconds` after the signal: then every open request is cancelled, and a stream that was
cut ends with an error event saying so (its last event: no `[DONE]` follows an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web

from tokenpipe import sse
from tokenpipe.errors import GatewayError

log = logging.getLogger("tokenpipe.front")

#: Seconds a client is told to wait before retrying elsewhere while this process drains.
RETRY_AFTER = 1.0
#: Seconds given to cancelled handlers to write their last event and end (after the cut).
_CUT_WAIT = 1.0


class Drain:
    """The API requests in flight (one handler task each; bounded by the server's connection
    count) and the shutdown cut."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[object]] = set()
        self.cutting = False

    async def run(self, grace: float, drain: float) -> None:
        """Returns when every request ended, or after cutting those still open at `drain`
        seconds. Called at SIGTERM, after the front was marked draining."""
        start = time.monotonic()
        await asyncio.sleep(min(grace, drain))  # probes and balancers see the 503s
        remaining = drain - (time.monotonic() - start)
        open_tasks = set(self.tasks)
        if open_tasks and remaining > 0:
            await asyncio.wait(open_tasks, timeout=remaining)
        left = [t for t in self.tasks if not t.done()]
        if not left:
            return
        log.warning("cutting %d open request(s): drain_seconds reached", len(left))
        self.cutting = True
        for t in left:
            t.cancel()
        await asyncio.wait(left, timeout=_CUT_WAIT)


def refusal() -> GatewayError:
    return GatewayError(
        503,
        "The gateway is shutting down; retry (another instance will answer).",
        code="draining",
        retry_after=RETRY_AFTER,
    )


async def end_cut_stream(
    response: web.StreamResponse, encode: Callable[[GatewayError], bytes] | None = None
) -> None:
    """The last words of a stream cut by shutdown: one error event, nothing after it
    (`encode`: the error event of the stream's API; default OpenAI chat's)."""
    error = GatewayError(
        503,
        "The stream was cut: the gateway is shutting down (drain_seconds reached). "
        "The answer is incomplete.",
        code="shutdown",
    )
    with contextlib.suppress(ConnectionError, RuntimeError):
        await response.write(encode(error) if encode else sse.encode(error.json()))
        await response.write_eof()


#: Where the HTTP front keeps a request's started SSE response (so a cut can end it).
STREAM = "tokenpipe_sse_response"
#: The stream's error event encoder when its API is not chat's (`Dialect.error_event`).
ERROR_EVENT = "tokenpipe_sse_error_event"


def middleware(drain: Drain, draining: Callable[[], bool]) -> Any:
    """Refuses new API requests while draining; tracks and, at the cut, ends the open ones.
    Inside errors_middleware, which turns the refusal into JSON."""

    @web.middleware
    async def drain_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):  # probes, metrics: always answered
            return cast(web.StreamResponse, await handler(request))
        if draining():
            raise refusal()
        task = asyncio.current_task()
        assert task is not None
        drain.tasks.add(task)
        try:
            return cast(web.StreamResponse, await handler(request))
        except asyncio.CancelledError:
            if not drain.cutting:
                raise  # the client went away (handler cancellation)
            task.uncancel()
            response: web.StreamResponse | None = request.get(STREAM)
            if response is None or not response.prepared:
                raise GatewayError(
                    503, "The gateway is shutting down.", code="shutdown", retry_after=RETRY_AFTER
                ) from None
            await end_cut_stream(response, request.get(ERROR_EVENT))
            return response
        finally:
            drain.tasks.discard(task)

    return drain_middleware
