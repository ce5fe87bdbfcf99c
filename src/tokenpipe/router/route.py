"""One request's way through the upstreams: its first send (`open_route`), then the state its
stream's reader works on (`Route`): the response read now, the side sends of hedges, retries
and continuations and their tickets, and the stall deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenpipe import sse
from tokenpipe.control.traffic import Ticket
from tokenpipe.errors import GatewayError
from tokenpipe.router.attempt import Attempt, Request, Tries, until_answered
from tokenpipe.router.policy import Policy
from tokenpipe.upstream.h1 import UpstreamResponse
from tokenpipe.upstream.http import HttpUpstream

if TYPE_CHECKING:
    from tokenpipe.relay.buffer import Accumulator
    from tokenpipe.relay.events import EventParser


async def open_route(policy: Policy, req: Request, ticket: Ticket) -> Route:
    """Sends the request, retrying and falling back on connect errors, 5xx and 429 (the one
    retry loop); returns at the response headers, so the client's stream (and its role chunk)
    starts at once. The response is any status a retry would not change, or the last failure
    when no retry is left. A stream's first token is raced for later, by its reader."""
    policy.retry_budget.request()
    policy.hedge_budget.request()
    a = await until_answered(
        policy,
        req,
        Tries(policy.send_limit()),
        body=req.body,
        first_token=False,
        ticket=lambda: ticket,
    )
    if a is None:  # no upstream to send to (candidates raise a 404 before this)
        raise GatewayError(502, "No upstream could take the request.", code="upstream_unavailable")
    if a.ok or (a.resp is not None and a.fatal is None):
        return Route(policy, req, ticket, a)  # the answer, or the last failure as it was
    try:
        raise a.failure()
    finally:  # the error's traceback holds this frame: its locals must not hold the error
        del a


def _adopt(ticket: Ticket, side: Ticket) -> None:
    """The client's answer now comes from `side`'s send (a hedge or a retry): the request's
    own ticket takes over that permit, released when the request ends; `side` takes the
    request's old one (released already, when its attempt was closed)."""
    ticket.permit, side.permit = side.permit, ticket.permit
    ticket.status = side.status


class Route:
    """The state of one request after its first send (see the module docstring).

    Bounded: one hedge, `retries.max_attempts` retries and `recovery.max_continuations`
    continuations, each one response and one side ticket, closed with the request.
    """

    __slots__ = (
        "_side",
        "continuations",
        "policy",
        "raced",
        "recorded",
        "req",
        "responses",
        "sent_at",
        "span",
        "stall",
        "ticket",
        "upstream",
        "uresp",
    )

    def __init__(self, policy: Policy, req: Request, ticket: Ticket, a: Attempt) -> None:
        assert a.resp is not None
        self.policy = policy
        self.req = req
        self.ticket = ticket
        self.upstream: HttpUpstream = a.upstream
        self.uresp: UpstreamResponse = a.resp
        #: The span of the attempt read now (tracing.NO_SPAN untraced): ends when it is
        #: replaced (`switch`) or the route closes.
        self.span = a.span
        self.sent_at = a.sent_at if a.sent_at is not None else policy.clock.now()
        self.stall: float | None = None  # seconds, None: off (set for a stream)
        if req.stream and a.resp.status == 200:
            self.stall = policy.stall_deadline(a.upstream.name, req.model)
        self.raced = False  # the race for the first token ran (the reader sets it)
        rec = policy.settings.recovery
        self.continuations = Tries(rec.max_continuations, label="midstream")
        # Content is recorded only when a cut stream could continue somewhere.
        dialect = req.dialect
        self.recorded = rec.enabled and policy.continues(dialect) and dialect.continuable(req.obj)
        self.responses: list[UpstreamResponse] = []
        self._side: list[Ticket] = []

    def side_ticket(self) -> Ticket:
        """A ticket for an extra send: charged to the upstream's limiter (RPM/TPM), not again
        to the client's key quota; waits within the request's scope."""
        t = self.ticket
        side = Ticket(t.traffic, t.key, t.cost, None, t.scope)
        self._side.append(side)
        return side

    def switch(self, a: Attempt, parser: EventParser, acc: Accumulator) -> UpstreamResponse:
        """Reads on from attempt `a`: its events up to its first content were read into
        `a.prefix`; those before the content are dropped (the client has its role chunk)."""
        assert a.resp is not None
        self.uresp.close()
        self.span.end("replaced")  # its outcome marked by who replaced it (lost, cut, ...)
        self.span = a.span
        _adopt(self.ticket, a.ticket)
        if a.sent_at is not None and a.first_at is not None:
            self.policy.ttft_estimate(a.upstream.name, self.req.model, self.req.cls).add(
                a.first_at - a.sent_at
            )
        self.upstream = a.upstream
        self.sent_at = a.sent_at or self.sent_at
        self.uresp = a.resp
        self.responses.append(a.resp)
        parser.decoder = sse.SSEDecoder()  # a partial event of the old stream is dropped
        content = False
        for chunk in a.prefix:
            if parser.at_end():  # raises a fault in what was read (the reader reports it)
                break
            for piece in parser.feed(chunk):
                if not content and not piece.first:
                    continue
                content = True
                acc.put(piece)
        parser.at_end()
        return a.resp

    # -- after the first token ---------------------------------------------------------------

    def read_deadline(self, since: float) -> float:
        """When a read that started at `since` times out: the stall deadline after it, or
        the end of the request's scope if sooner."""
        # The upstream's fixed read timeout bounds it whatever the adaptive deadline.
        cap = self.upstream.settings.read_timeout_seconds
        return min(since + (cap if self.stall is None else min(self.stall, cap)), self.req.scope.at)

    def gap(self, seconds: float) -> None:
        self.policy.gap_estimate(self.upstream.name, self.req.model).add(seconds)

    def client_expired(self) -> bool:
        """The client's own deadline has passed (what ended the stream is not evidence
        against the upstream)."""
        return self.req.scope.client_passed()

    def stall_error(self) -> GatewayError:
        """The error for a read that timed out: the bound that was hit."""
        scope = self.req.scope
        if scope.passed():
            self.span.mark("deadline")
            return scope.error(False)
        cap = self.upstream.settings.read_timeout_seconds
        if self.stall is not None and self.stall < cap:
            bound = f"the stall deadline of {self.stall:.3g} s"
        else:
            bound = f"the upstream's read timeout of {cap:.3g} s"
        self.span.stall(bound)
        return GatewayError(
            504, f"the upstream stopped sending (no bytes within {bound})", code="upstream_timeout"
        )

    def close(self) -> None:
        """Closes the response and every extra one, and finishes every side ticket, whatever
        one of them raises (the first error is raised at the end)."""
        first: BaseException | None = None
        self.span.end("answered")  # (won: a race's winner; a failure the client got: its own)
        steps: list[Callable[[], object]] = [self.uresp.close]
        for r in self.responses:  # (loops, not comprehensions: usually both lists are empty)
            steps.append(r.close)
        for t in self._side:
            steps.append(t.finish)
        for step in steps:
            try:
                step()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first


async def cancel(task: asyncio.Task[Any]) -> None:
    """Cancels `task` and waits for it. A cancellation of the caller itself (the client
    left while we waited) is not swallowed: it is raised once the task is done, even when it
    came in the same step as the task's own end (the task being done then says nothing about
    whose cancellation this is; the caller's pending `cancelling()` count does)."""
    task.cancel()
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        me = asyncio.current_task()  # (only here: the lookup costs a system call, getpid)
        if not task.done() or (me is not None and me.cancelling()):
            try:  # the caller was cancelled: let the task finish, then go
                await asyncio.shield(task)
            except (asyncio.CancelledError, Exception):
                pass
            raise
    except Exception:
        pass  # its outcome no longer matters (it closed what it opened)
