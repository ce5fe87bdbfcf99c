"""Does an `openai` upstream serve the Responses API itself (`upstreams[].responses: auto`)?
Asked once, by the first /v1/responses request that could go to it, and remembered.

The question is `POST /responses` with the body `{}`: a server with the route refuses that body
(400; 422 from a FastAPI server) before any model runs, one without it answers 404 (405 or
501 from some). Any other answer (none within the time allowed, a 5xx, 401, 429) says
nothing: meanwhile requests are translated to chat, as for a `chat` upstream, and the upstream
is asked again after RETRY seconds.

Only the first request waits for the answer (one round trip on a pooled connection, at most
TIMEOUT): requests that arrive while it is asked take the last answer (chat before the
first), so a cold burst never queues behind the probe. Once there is a definite answer, it is
asked again (past TTL, or RETRY after an answer that said nothing) in the background, and the
request that found it due takes the last answer too: before, one request an hour waited.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from tokenpipe.flight import SingleFlight

#: Longest wait of the request that asks (seconds): an answer to `{}` needs no model, so two
#: seconds cover a fresh TLS connection across an ocean many times over.
TIMEOUT = 2.0
#: How long an answer is trusted (seconds): a server upgraded to the Responses API (or
#: rolled back) is noticed within the hour, at the cost of one request per hour.
TTL = 3600.0
#: How long after an answer that said nothing the upstream is not asked again (seconds).
RETRY = 30.0
#: Statuses that mean the route exists (the body was refused, or, oddly, accepted).
SERVED = frozenset({200, 400, 422})
#: Statuses that mean it does not.
NOT_SERVED = frozenset({404, 405, 501})

#: Sends the question, waiting at most the seconds given; the status of the answer, or None
#: when none came.
Ask = Callable[[float], Awaitable[int | None]]


def verdict(status: int | None) -> bool | None:
    """True: served; False: not served; None: the answer says nothing."""
    if status in SERVED:
        return True
    if status in NOT_SERVED:
        return False
    return None


class ResponsesProbe:
    """The cached answer for one upstream, on an injected clock (seconds)."""

    def __init__(self, ask: Ask, clock: Callable[[], float] = time.monotonic) -> None:
        self._ask = ask
        self._clock = clock
        #: The last definite answer (None: never had one).
        self._served: bool | None = None
        #: When the upstream is asked next (clock seconds): now, at first.
        self._due = -1.0
        self._asking = False
        #: The question asked again in the background (`now`): one at a time, its error
        #: retrieved (flight.py).
        self._flight: SingleFlight[bool] = SingleFlight()
        self._again: asyncio.Task[bool] | None = None  # the last one

    def now(self) -> bool | None:
        """The answer without asking, or None when this caller should ask (`served`): only
        before the first definite answer; after it, a due question is asked in the
        background and the last answer stands meanwhile."""
        if self._asking or self._clock() < self._due:
            return self._served is True
        if self._served is None:
            return None
        self._asking = True
        self._again = self._flight.start(None, lambda: self._answer(TIMEOUT))
        return self._served

    async def served(self, limit: float = TIMEOUT) -> bool:
        """The answer, asked for when due, waiting at most `limit` (capped at TIMEOUT)
        seconds."""
        known = self.now()
        if known is not None:
            return known
        self._asking = True
        return await self._answer(min(limit, TIMEOUT))

    async def _answer(self, limit: float) -> bool:
        try:
            status = await self._ask(limit)
        finally:  # cancelled with its request: the next request asks
            self._asking = False
        found = verdict(status)
        now = self._clock()
        if found is None:
            self._due = now + RETRY
        else:
            self._served, self._due = found, now + TTL
        return self._served is True

    @property
    def answer(self) -> bool | None:
        """The last definite answer (None: none yet)."""
        return self._served
