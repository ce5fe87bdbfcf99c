"""The summarize policy's call: one bounded chat completion that summarises dropped history.

The cache, the prefix hashes and the prompt's wording are in `summary`; this is the call
itself, through the router and the upstream limiter, under `summary_deadline_seconds`. A
timeout or a failed call is returned as a note, not raised: the hop then truncates instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson

from tokenpipe import request_ids, sse
from tokenpipe import usage as usage_mod
from tokenpipe.context import plan, summary, tokens
from tokenpipe.context.lookup import ModelLookup
from tokenpipe.control.deadline import UNBOUNDED, Scope
from tokenpipe.control.traffic import Ticket
from tokenpipe.dialects import CHAT
from tokenpipe.dialects.chat_upstream import read_completion
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics, tracing
from tokenpipe.router.attempt import Request
from tokenpipe.router.policy import Policy
from tokenpipe.router.route import open_route
from tokenpipe.settings import ContextSettings
from tokenpipe.upstream.errors import UpstreamError
from tokenpipe.upstream.http import read_bounded

log = logging.getLogger("tokenpipe.context")

#: Largest summary response read (bytes); a larger one is treated as a failed summary.
MAX_SUMMARY_BYTES = 1 << 20
#: Characters a summary may hold per token of `summary_max_tokens`: a token is ~4 characters
#: of English, rarely more than 10 in any script. A longer summary is an upstream that did
#: not honour max_tokens: it fails (the request is truncated instead) and is not cached. A
#: cache of 1,024 summaries of up to 1 MiB each (MAX_SUMMARY_BYTES) grew the gateway by
#: ~1 GiB, every such summary then refused as too long for the window anyway.
MAX_CHARS_PER_TOKEN = 16


class Summarizer:
    def __init__(
        self,
        settings: ContextSettings,
        policy: Policy,
        lookup: ModelLookup,
        cache: summary.SummaryCache,
        tickets: Callable[[dict[str, Any]], Ticket] | None = None,
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.lookup = lookup
        self.cache = cache
        #: Passage through the upstream limiters for summary calls (None: they go unlimited).
        self.tickets = tickets

    async def summarize(
        self,
        model: str,
        messages: list[dict[str, Any]],
        older: list[dict[str, Any]],
        scope: Scope = UNBOUNDED,
        trace: tracing.RequestTrace = tracing.OFF,
    ) -> tuple[str | None, str]:
        """(summary of `older` or None to truncate instead, what happened for the header).
        The wait is bounded by `summary_deadline_seconds` and the request's `scope`. A call
        made is a CLIENT span under `trace` (one reused from the cache is none)."""
        convo = [m for m in messages if m.get("role") not in plan.KEPT_ROLES]
        n = len(older)
        hashes = summary.prefix_hashes(convo[:n])
        have, previous = self.cache.longest(hashes, n)
        if have == n and previous is not None:
            metrics.CONTEXT_SUMMARIES.labels("reused").inc()
            return previous, "reused"
        fresh = convo[have:n]
        summarizer = self.settings.summarizer_model or model
        try:
            # (asyncio.timeout: wait_for may lose a cancellation, see control/limiter.py)
            async with asyncio.timeout(scope.cap(self.settings.summary_deadline_seconds)):
                text = await self.cache.once(
                    hashes[n], lambda: self._write(summarizer, previous, fresh, trace)
                )
        except TimeoutError:
            metrics.CONTEXT_SUMMARIES.labels("timeout").inc()
            return None, "timeout"
        except (GatewayError, UpstreamError, ValueError) as e:
            # Absorbed here: its traceback goes, so the log record that keeps `e` (a handler
            # may hold records) does not keep the summary call's frames and the answer they
            # read. (The cycle through the cache's future is broken in SummaryCache.once.)
            e.__traceback__ = None
            log.warning("context: summary by %s failed: %s", summarizer, e)
            metrics.CONTEXT_SUMMARIES.labels("failed").inc()
            return None, "failed"
        metrics.CONTEXT_SUMMARIES.labels("extended" if previous else "new").inc()
        return text, ("extended" if previous else "new")

    async def _write(
        self,
        model: str,
        previous: str | None,
        fresh: list[dict[str, Any]],
        trace: tracing.RequestTrace,
    ) -> str:
        """One call to the summarising model, its span around it (traced)."""
        with trace.summary(model) as span:
            return await self._call(model, previous, fresh, trace.under(span, model))

    async def _call(
        self,
        model: str,
        previous: str | None,
        fresh: list[dict[str, Any]],
        trace: tracing.RequestTrace,
    ) -> str:
        """One call to the summarising model with the previous summary and the new messages."""
        counter = await self.lookup.counter(model)
        window = await self.lookup.window(model)
        max_tokens = self.settings.summary_max_tokens
        if window is not None:
            # Newest messages first until the summarizer's own window is full: what does not
            # fit is left out (truncated), so a summary is always one bounded call.
            budget = (
                window
                - max_tokens
                - self.settings.margin_tokens
                - counter.count(summary.FRAME)
                - counter.count(previous or "")
            )
            start = len(fresh)
            while start > 0:
                cost = tokens.count_message(counter, fresh[start - 1])
                if cost > budget:
                    break
                budget -= cost
                start -= 1
            fresh = fresh[start:]
            if not fresh and previous is None:
                raise ValueError("no message fits the summarizer's window")
        request = {
            "model": model,
            "stream": False,
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": summary.INSTRUCTIONS},
                {"role": "user", "content": summary.transcript(previous, fresh)},
            ],
        }
        # Through the router's whole policy (breaker, retries within the budget, fallbacks)
        # and the upstream limiter (it waits for capacity and learns from the answer), all
        # within the summary's own deadline. Its scope is the gateway's, not one client's:
        # several requests may wait for the same summary (SummaryCache.once).
        scope = Scope.open(self.settings.summary_deadline_seconds, None, self.policy.clock)
        if self.tickets is None:
            raise ValueError("summary calls need the upstream limiter")
        ticket = self.tickets(request)
        body = orjson.dumps(request)
        req = Request(
            model,
            CHAT,
            request,
            body,
            "ctx-summary-" + request_ids.new(),
            scope,
            stream=False,
            trace=trace,
        )
        usage = None
        status: int | None = None
        try:
            ticket.scope = scope
            route = await open_route(self.policy, req, ticket)
            try:
                status = route.uresp.status
                raw = await read_bounded(route.uresp, MAX_SUMMARY_BYTES)
            finally:
                route.close()
            if status != 200:
                raise ValueError(f"summarizer answered {status}")
            try:  # the fields read, not the whole answer (dialects/event_json.py)
                answer = read_completion(raw) or {}  # ({}: not JSON)
                text = answer["choices"][0]["message"]["content"]
            except (sse.SSEProtocolError, KeyError, IndexError, TypeError):
                raise ValueError("summarizer answer is not a chat completion") from None
            usage = answer.get("usage")  # a dict: indexing it by name worked
        finally:
            ticket.finish(usage_mod.clean(usage), status)
        if not isinstance(text, str) or not text.strip():
            raise ValueError("summarizer wrote an empty summary")
        if len(text) > MAX_CHARS_PER_TOKEN * max_tokens:
            raise ValueError(f"summarizer wrote {len(text)} characters for max_tokens {max_tokens}")
        return text.strip()
