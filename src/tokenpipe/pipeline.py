"""The request path below the protocol fronts, shared by HTTP and gRPC, in this order:
deadline scope -> per-key admission -> context budget -> router (limiter wait, attempts,
retries, fallbacks) -> the upstream call, whose stream the relay then moves.

Layer: below the fronts; above context, router and relay. The fronts hand it a parsed request
and get a `Call` back: the upstream's answer, read whole (`read_whole`) or relayed
(`relay`), and `close(status)`, which releases everything the request holds.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from tokenpipe import answer_fields
from tokenpipe import usage as usage_mod
from tokenpipe.clock import Timeout
from tokenpipe.context.budget import ContextBudget, ContextOutcome
from tokenpipe.control.auth import Authenticator
from tokenpipe.control.bodies import BodyMemory, ParseTime
from tokenpipe.control.deadline import Scope
from tokenpipe.control.flowgate import FlowGate
from tokenpipe.control.traffic import Ticket, TrafficControl
from tokenpipe.dialects import CHAT, COMPLETIONS, Dialect
from tokenpipe.dialects import openai_schema as schema
from tokenpipe.dialects.chat_via_messages import ChatViaMessages
from tokenpipe.dialects.messages_via_chat import MessagesViaChat
from tokenpipe.errors import GatewayError, dumps_request
from tokenpipe.observe import tracing
from tokenpipe.observe.server_timing import Timing
from tokenpipe.relay.buffer import WriteNow
from tokenpipe.relay.events import EventParser, Record
from tokenpipe.relay.stream import Emit, relay_stream
from tokenpipe.relay.tally import StreamTally
from tokenpipe.router import Router
from tokenpipe.router.attempt import Request
from tokenpipe.router.policy import Policy
from tokenpipe.router.route import Route, open_route
from tokenpipe.router.stream import reader
from tokenpipe.settings import Settings
from tokenpipe.upstream.h1 import UpstreamResponse
from tokenpipe.upstream.http import HttpUpstream, read_bounded

DIALECTS: dict[type[Any], Dialect] = {
    schema.ChatRequest: CHAT,
    schema.CompletionRequest: COMPLETIONS,
}
T = TypeVar("T")
#: Client API (dialect name) -> its translation onto the other API's upstreams (per request).
TRANSLATIONS: dict[str, type[ChatViaMessages] | type[MessagesViaChat]] = {
    "chat": ChatViaMessages,
    "messages": MessagesViaChat,
}


#: How long the start's warm-up asks an upstream that does not answer yet (seconds), and
#: its first pause between two asks (doubled each time, up to 8 s).
WARM_SECONDS = 60.0
WARM_FIRST_PAUSE = 0.5


def _call_soon(fn: Callable[[], None]) -> None:
    asyncio.get_running_loop().call_soon(fn)


class Gateway:
    """Everything a request needs, built once per process from the settings."""

    def __init__(self, settings: Settings, router: Router) -> None:
        self.settings = settings
        self.router = router
        self.auth = Authenticator(settings.auth.api_keys)
        self.traffic = TrafficControl(settings)
        # The latency estimates' refreshes wait for the request to wait (its upstream's
        # answer), rather than delaying its upstream write (control/quantiles.py).
        self.policy = Policy(settings.tail, router, defer=_call_soon)
        self.context = ContextBudget(settings.context, self.policy, self.traffic.internal)
        self.draining = False
        #: What the requests being served hold, both fronts (server.max_body_memory_bytes).
        self.bodies = BodyMemory(settings.server.max_body_memory_bytes)
        #: The share of the loop each key's bodies take to parse (max_parse_share_per_key).
        self.parsing = ParseTime(settings.server.max_parse_share_per_key, self.policy.clock)
        #: The APIs the upstreams speak: with one, no request is translated.
        self.apis = frozenset(u.settings.api for u in router.upstreams)

    async def start(self) -> None:
        await self.traffic.start()

    async def warm(self) -> None:
        """What a first request would wait for, done at start, in the background: each
        upstream asked for its /models (its first connection opened and kept warm, its host
        looked up, its model list and windows learned) and the configured models' token
        counters loaded. Without it, each process's first request waited for all of that:
        on loopback 1.9 ms of its context phase, to a remote upstream a TCP and a TLS
        handshake and the /models round trip."""
        await asyncio.gather(self.context.lookup.warm(), *map(self._warm, self.router.upstreams))

    async def _warm(self, upstream: HttpUpstream) -> None:
        # An upstream still starting (tokenpipe local loads its model) is asked again, 0.5,
        # 1, 2, 4, 8, 8... s apart, for at most WARM_SECONDS; a request meanwhile joins the
        # ask in flight or asks itself, as it would have without the warm-up.
        delay, waited = WARM_FIRST_PAUSE, 0.0
        while True:
            data = await upstream.warm()
            if data is not None:
                self.context.lookup.discovery.learn(upstream, data)
                return
            if waited + delay > WARM_SECONDS:
                return
            await asyncio.sleep(delay)  # (a retry's pause, not a wait for state)
            waited += delay
            delay = min(2 * delay, 8.0)

    async def close(self) -> None:
        await self.traffic.close()
        await self.router.close()

    async def _dialect(self, native: Dialect, model: str, obj: dict[str, Any]) -> Dialect:
        """The request's API on its upstreams: native when an upstream of the client's API
        serves the model, else a translation onto one that does (chat on an Anthropic
        upstream, Messages on an OpenAI one). A request never falls over between APIs."""
        translation = TRANSLATIONS.get(native.name)
        if translation is None or self.apis == {native.api}:
            return native
        if native.api in self.apis and await self.router.candidates(
            model, native.api, required=False
        ):
            return native
        if translation.api not in self.apis:
            return native  # the router's 404 names the model
        await self.router.candidates(model, translation.api)  # 404 when neither serves it
        return translation(obj)

    def scope(self, headers: Mapping[str, str]) -> Scope:
        """The request's one deadline scope: `tail.total_seconds` or the client's
        x-tokenpipe-deadline-seconds, whichever is shorter (400 for a header that is not a
        number). Created when the request arrives; every wait below lies inside it."""
        return Scope.open(self.settings.tail.total_seconds, headers, self.policy.clock)

    async def open(
        self,
        kind: type[Any],
        req: Any,
        obj: dict[str, Any],
        body: bytes,
        *,
        key: str,
        request_id: str,
        started: float,
        headers: Mapping[str, str],
        scope: Scope | None = None,
        pace: float | None = None,
        dialect: Dialect | None = None,
        timing: Timing | None = None,
    ) -> Call:
        """Sends the request upstream; returns once the upstream's headers arrived.

        `obj` is the request as the client sent it; `body` its bytes, forwarded unchanged
        unless a hop below must change the request. `pace`: tokens per second the client
        asked for (the upstream is told, so a generating engine can slow down too).
        `dialect`: the API of the request's events and its upstreams (default: `kind`'s).
        `timing`: where the phases' marks go (Server-Timing; the front's, to answer errors)."""
        if timing is None:
            timing = Timing(started)
        timing.opened = now()
        if scope is None:
            scope = self.scope(headers)
        # The front's server span, if it opened one (tracing.OFF: no-op hooks).
        trace = tracing.CURRENT.get()
        native = dialect or DIALECTS[kind]
        trace.request(native.name, req.model, bool(req.stream), obj)
        # The key's quota first: an over-quota key costs nothing more (no token counting, no
        # summary call). 429 when over. (An embedding generates nothing: no output reserved.)
        admit = self.traffic.admit(key, obj, scope, output=native.output)
        with trace.step("admission"):
            ticket = await _within(scope, admit, "admission")
        timing.admitted = now()
        try:
            return await self._open(
                kind,
                req,
                obj,
                body,
                ticket,
                request_id,
                started,
                headers,
                pace,
                dialect,
                timing,
                trace,
            )
        except BaseException:
            ticket.finish()
            raise

    async def _open(
        self,
        kind: type[Any],
        req: Any,
        obj: dict[str, Any],
        body: bytes,
        ticket: Ticket,
        request_id: str,
        started: float,
        headers: Mapping[str, str],
        pace: float | None,
        dialect: Dialect | None,
        timing: Timing,
        trace: tracing.RequestTrace,
    ) -> Call:
        scope = ticket.scope
        ctx = await _within(
            scope, self.context.apply(kind, req, obj, headers, scope, trace), "context budget"
        )
        changed = ctx.body is not None  # may shorten the request
        if changed:
            ticket.cost = self.traffic.cost(obj)  # the limiter charges what is sent
        native = dialect or DIALECTS[kind]
        dialect = await self._dialect(native, req.model, obj)
        strip_usage = False
        upstreams = None
        if req.stream:
            changed = dialect.strip_extensions(obj) or changed
            if not dialect.wants_usage(obj):
                upstreams = await self.router.candidates(req.model, dialect.api)
                if all(u.settings.request_usage for u in upstreams):
                    # Usage is what quotas and metrics count: asked for on the client's
                    # behalf, and removed again from what the client gets.
                    dialect.ask_usage(obj)
                    changed = strip_usage = True
        translated = dialect.upstream_request(obj)  # another API's upstream: its request
        if translated is not None:
            body = dumps_request(translated)
        elif changed:
            body = dumps_request(obj)
        request = Request(
            req.model,
            dialect,
            obj,
            body,
            request_id,
            scope,
            stream=bool(req.stream),
            prompt_tokens=ticket.cost.prompt,
            pace=pace,
            trace=trace,
            upstreams=upstreams,
        )
        timing.prepared = now()
        clock = self.policy.clock  # the router's: its send time is on it
        routing = clock.now()
        # Limiter wait, deadlines, retries, hedging, fallbacks, circuit breaking (router/).
        route = await open_route(self.policy, request, ticket)
        timing.upstream_headers = clock.now() - route.sent_at
        timing.queue = route.sent_at - routing
        try:
            tally = StreamTally(route.upstream.name, req.model, started, native.label, trace)
            parser = EventParser(tally, strip_usage, dialect.for_stream())
            return Call(route, tally, ticket, ctx, parser, timing)
        except BaseException:  # no Call to close it: the route ends here
            route.close()
            raise


async def _within(scope: Scope, step: Awaitable[T], where: str) -> T:
    """Awaits `step` within the request's scope: past it, the scope's 504."""
    if scope.at == math.inf:  # unbounded (`scope.bounded`, without its call)
        return await step
    try:
        with Timeout(scope.left()):
            return await step
    except TimeoutError:
        if scope.passed():
            raise scope.error(True, where) from None
        raise


class Call:
    """One upstream call in flight. `close(status)` must run exactly once, whatever happens."""

    __slots__ = ("ctx", "gauge", "parser", "route", "tally", "ticket", "timing")

    def __init__(
        self,
        route: Route,
        tally: StreamTally,
        ticket: Ticket,
        ctx: ContextOutcome,
        parser: EventParser | None = None,
        timing: Timing | None = None,
    ) -> None:
        #: The upstream answer and everything sent for it (hedges, retries, continuations).
        self.route = route
        self.tally = tally
        self.ticket = ticket
        self.ctx = ctx
        self.parser = parser
        #: The request's phase marks (Server-Timing).
        self.timing = timing if timing is not None else Timing(tally.started_at)
        self.gauge = tally.series.inflight
        self.gauge.inc()

    @property
    def uresp(self) -> UpstreamResponse:
        return self.route.uresp

    @property
    def upstream(self) -> HttpUpstream:
        return self.route.upstream

    @property
    def dialect(self) -> Dialect:
        """The API of the events (and bodies) the client gets."""
        return self.route.req.dialect

    async def read_whole(
        self, limit: int | None = None
    ) -> tuple[bytes, answer_fields.Fields | None]:
        """The whole body of a non-streamed answer (or an upstream error), bounded, and the
        fields the gateway reads of it (None: not a JSON object), read once for the front
        and the span."""
        uresp = self.route.uresp
        body = await (read_bounded(uresp) if limit is None else read_bounded(uresp, limit))
        fields = answer_fields.read(body)
        self.tally.trace.answer(uresp.status, fields, body)  # (traced only) model, reasons
        return body, fields

    async def relay(
        self,
        emit: Emit,
        gate: FlowGate | None = None,
        gate_changed: asyncio.Event | None = None,
        write_now: WriteNow | None = None,
        ready: Callable[[], bool] | None = None,
        task: asyncio.Task[Any] | None = None,
    ) -> GatewayError | None:
        """Relays the stream to the client (relay.relay_stream with the router's reader);
        returns why it ended early, if it did. `task`: the caller's (the front's request's),
        when it has it."""
        assert self.parser is not None
        read = reader(self.route, self.parser)
        if self.tally.trace.capture and self.parser.record is None:
            self.parser.record = Record()  # the text for the span (bounded: RECORD_MAX_BYTES)
        return await relay_stream(read, emit, gate, gate_changed, write_now, ready, task)

    def close(self, status: int) -> None:
        """Releases everything, whatever a step raises: one `finally` per resource (a step
        that raised must not leave the limiter permit or the key's slot taken for good).
        The first error is raised after all steps ran."""
        tally = self.tally
        try:
            if status == 499:  # the client went away (front's CLIENT_CLOSED)
                self.route.span.mark("cancelled")
            # At once: a client that went away must not keep the upstream busy. Hedge, retry
            # and continuation responses and their tickets go with it.
            self.route.close()
        finally:
            try:
                self.gauge.dec()
            finally:
                # Upstream values are checked before anything counts them (usage.py).
                tally.usage = usage_mod.clean(tally.usage, self.route.upstream.name)
                try:
                    tally.finish(status)
                finally:
                    try:
                        self.ticket.finish(tally.usage, self._ticket_status(status))
                    finally:
                        try:
                            self.ctx.observe(tally.usage)
                        finally:
                            if self.parser is not None:
                                tally.trace.output(self.parser.recorded()[0])  # (captured only)
                                self.parser.close()

    def _ticket_status(self, status: int) -> int | None:
        """What the limiter learns from: a stream cut by the client's own deadline says
        nothing about the upstream (no AIMD drop)."""
        if self.route.client_expired():
            return None
        return status


def now() -> float:
    """The clock of request timing (TTFT, durations): perf_counter, monotonic on Linux."""
    return time.perf_counter()
