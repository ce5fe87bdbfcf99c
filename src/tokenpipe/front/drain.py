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
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from tokenpipe import sse
from tokenpipe.errors import GatewayError

if TYPE_CHECKING:
    from tokenpipe.front.wire import Request, Response, StreamResponse

    Answer = Response | StreamResponse

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


def _openai_event(error: GatewayError) -> bytes:
    return sse.encode(error.json())


async def end_cut_stream(
    response: StreamResponse, error_event: Callable[[GatewayError], bytes] = _openai_event
) -> None:
    """The last words of a stream cut by shutdown: one error event (of the stream's API),
    nothing after it."""
    error = GatewayError(
        503,
        "The stream was cut: the gateway is shutting down (drain_seconds reached). "
        "The answer is incomplete.",
        code="shutdown",
    )
    with contextlib.suppress(ConnectionError, RuntimeError):
        await response.write(error_event(error))
        await response.write_eof()


async def tracked(
    drain: Drain,
    draining: bool,
    request: Request,
    handler: Callable[[Request], Awaitable[Answer]],
) -> Answer:
    """An API request's handler, refused while draining, tracked while it runs, and at the
    cut ended (a started stream with its API's error event, else a 503). Its GatewayErrors
    are answered by the caller (front/http.py dispatch)."""
    if draining:
        raise refusal()
    # The connection's task for it (a lookup, asyncio.current_task(), costs a getpid system
    # call in CPython 3.11), else looked up.
    task = request.task or asyncio.current_task()
    assert task is not None
    drain.tasks.add(task)
    try:
        return await handler(request)
    except asyncio.CancelledError:
        if not drain.cutting:
            raise  # the client went away (its connection cancelled the handler)
        task.uncancel()
        response = request.sse
        if response is None or not response.prepared:
            raise GatewayError(
                503, "The gateway is shutting down.", code="shutdown", retry_after=RETRY_AFTER
            ) from None
        await end_cut_stream(response, request.error_event or _openai_event)
        return response
    finally:
        drain.tasks.discard(task)
