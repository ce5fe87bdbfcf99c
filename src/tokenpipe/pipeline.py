"""The request path below the protocol fronts, shared by HTTP and gRPC:
context budget -> per-key admission -> upstream limiter -> router -> the upstream call.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from tokenpipe import usage as usage_mod
from tokenpipe.context.budget import ContextBudget, ContextOutcome
from tokenpipe.control.traffic import Ticket, TrafficControl
from tokenpipe.front import schema
from tokenpipe.front.auth import Authenticator
from tokenpipe.observe import metrics
from tokenpipe.relay import StreamTally
from tokenpipe.router import Router
from tokenpipe.settings import Settings
from tokenpipe.tail import StreamGuard, TailControl
from tokenpipe.upstream.h1 import UpstreamResponse
from tokenpipe.upstream.http import HttpUpstream

PATHS = {schema.ChatRequest: "/chat/completions", schema.CompletionRequest: "/completions"}


class Gateway:
    """Everything a request needs, built once per process from the settings."""

    def __init__(self, settings: Settings, router: Router) -> None:
        self.settings = settings
        self.router = router
        self.auth = Authenticator(settings.auth.api_keys)
        self.traffic = TrafficControl(settings)
        self.context = ContextBudget(settings.context, router, self.traffic.internal)
        self.tail = TailControl(settings.tail, router)
        self.draining = False

    async def start(self) -> None:
        await self.traffic.start()

    async def close(self) -> None:
        await self.traffic.close()
        await self.router.close()

    async def open(
        self,
        kind: type[schema.ChatRequest] | type[schema.CompletionRequest],
        req: Any,
        obj: dict[str, Any],
        body: bytes,
        *,
        key: str,
        request_id: str,
        started: float,
        headers: Mapping[str, str],
        pace: float | None = None,
    ) -> Call:
        """Sends the request upstream; returns once the upstream's headers arrived.

        `obj` is the request as the client sent it; `body` its bytes, forwarded unchanged
        unless a hop below must change the request. `pace`: the rate (tokens/s) the client
        renders at, sent upstream with each attempt (a generating upstream paces to it)."""
        ctx = await self.context.apply(kind, req, obj, headers)  # may shorten the request
        changed = ctx.body is not None
        strip_usage = False
        if req.stream:
            opts = obj.get("stream_options")
            if isinstance(opts, dict) and "max_tokens_per_second" in opts:
                # tokenpipe's own extension: the relay paces to it; upstreams would reject it.
                opts = {k: v for k, v in opts.items() if k != "max_tokens_per_second"}
                obj["stream_options"] = opts
                changed = True
            wants_usage = bool(req.stream_options and req.stream_options.include_usage)
            if not wants_usage:
                upstreams = await self.router.candidates(req.model)
                if all(u.settings.request_usage for u in upstreams):
                    obj["stream_options"] = {
                        **(obj.get("stream_options") or {}),
                        "include_usage": True,
                    }
                    changed = strip_usage = True
        if changed:
            body = orjson.dumps(obj)
        # Per-key quota (429 when over; it needs the token count, so it follows the parse),
        # then the upstream limiter inside open(): waits for capacity, learns from the answer.
        ticket = await self.traffic.admit(key, obj)
        path = PATHS[kind]
        stream = bool(req.stream)
        try:
            # Deadlines, retries, hedging, fallbacks, circuit breaking (tail.py).
            upstream, uresp, sent_at, end = await self.tail.open(
                req.model, path, body, request_id, ticket, stream=stream, headers=headers, pace=pace
            )
        except BaseException:
            ticket.finish()
            raise
        try:
            guard = None
            if stream and uresp.status == 200:
                guard = StreamGuard(
                    self.tail,
                    upstream,
                    req.model,
                    path,
                    body,
                    obj,
                    request_id,
                    ticket,
                    sent_at,
                    end,
                    pace,
                )
            return Call(
                upstream,
                uresp,
                StreamTally(upstream.name, req.model, started),
                ticket,
                ctx,
                strip_usage,
                guard,
            )
        except BaseException:  # no Call to close it: the response and ticket end here
            try:
                uresp.close()
            finally:
                ticket.finish()
            raise


class Call:
    """One upstream call in flight. `close(status)` must run exactly once, whatever happens."""

    __slots__ = ("ctx", "gauge", "guard", "strip_usage", "tally", "ticket", "upstream", "uresp")

    def __init__(
        self,
        upstream: HttpUpstream,
        uresp: UpstreamResponse,
        tally: StreamTally,
        ticket: Ticket,
        ctx: ContextOutcome,
        strip_usage: bool,
        guard: StreamGuard | None = None,
    ) -> None:
        self.upstream = upstream
        #: Tail control for the stream (bytes read while racing, stall deadline, recovery);
        #: pass it to relay_stream.
        self.guard = guard
        self.uresp = uresp
        self.tally = tally
        self.ticket = ticket
        self.ctx = ctx
        self.strip_usage = strip_usage
        self.gauge = metrics.child(metrics.INFLIGHT, *tally.labels)
        self.gauge.inc()

    def close(self, status: int) -> None:
        """Releases everything, whatever a step raises: one `finally` per resource (a step
        that raised must not leave the limiter permit or the key's slot taken for good).
        The first error is raised after all steps ran."""
        tally = self.tally
        try:
            self.uresp.close()  # at once: a client that went away must not keep it busy
        finally:
            try:
                if self.guard is not None:
                    self.guard.close()  # hedge, retry and continuation responses, if any
            finally:
                try:
                    self.gauge.dec()
                finally:
                    # Upstream values are checked before anything counts them (usage.py).
                    tally.usage = usage_mod.clean(tally.usage, self.upstream.name)
                    try:
                        tally.finish(status)
                    finally:
                        try:
                            self.ticket.finish(tally.usage, self._ticket_status(status))
                        finally:
                            self.ctx.observe(tally.usage)

    def _ticket_status(self, status: int) -> int | None:
        """What the limiter learns from: a stream cut by the client's own deadline says
        nothing about the upstream (no AIMD drop)."""
        if self.guard is not None and self.guard.client_expired():
            return None
        return status


def now() -> float:
    """The clock of request timing (TTFT, durations): perf_counter, monotonic on Linux."""
    return time.perf_counter()
