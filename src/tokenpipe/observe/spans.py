"""tokenpipe's spans: one OpenTelemetry span each, ended once, with the outcome of an upstream
attempt; and `NoSpan`, which records nothing, for requests that are not traced (tracing off,
or left out by the sampler: then it still carries the request's context for the upstream).
The request-level hooks that open them are in observe/tracing.py."""

from __future__ import annotations

import asyncio
from functools import lru_cache
from types import TracebackType
from typing import Any

from opentelemetry import trace as otel
from opentelemetry.trace import Status, StatusCode
from yarl import URL

#: Attempt outcomes that are failures: the span's status is ERROR, `error.type` the outcome.
FAILED = frozenset(
    {
        "connect",
        "status_429",
        "status_5xx",
        "full",
        "ttft_deadline",
        "deadline",
        "broken",
        "cut",
        "stalled",
    }
)


class Span:
    """One span of tokenpipe's. `end` ends it once; an attempt's outcome
    (`tokenpipe.attempt.outcome`) is the first one marked, else the one `end` is given: the
    race marks its loser `lost` before the cancellation reaches the attempt's own code."""

    __slots__ = ("ended", "otel", "outcome", "started")
    on = True

    def __init__(self, span: otel.Span, started: int) -> None:
        self.otel = span
        self.started = started  # time.time_ns() at its start
        self.outcome: str | None = None
        self.ended = False

    def set(self, key: str, value: Any) -> None:
        self.otel.set_attribute(key, value)

    def status(self, code: int) -> None:
        """The upstream's HTTP status."""
        self.otel.set_attribute("http.response.status_code", code)

    def event(self, name: str) -> None:
        self.otel.add_event(name)

    def stall(self, bound: str) -> None:
        """A read hit the stall deadline (or the scope) after content."""
        self.otel.add_event("stall", {"tokenpipe.stall.bound": bound})
        self.mark("stalled")

    def mark(self, outcome: str) -> None:
        if self.outcome is None:
            self.outcome = outcome

    def fail(self, e: BaseException) -> None:
        """Ends the span with what raised in it (a cancellation is not an error)."""
        if isinstance(e, asyncio.CancelledError):
            self.otel.set_attribute("tokenpipe.cancelled", True)
        else:
            code = getattr(e, "code", None)
            self.otel.set_attribute("error.type", code or type(e).__name__)
            status = getattr(e, "status", None)
            if isinstance(status, int):
                self.otel.set_attribute("tokenpipe.error.status", status)
            self.otel.set_status(Status(StatusCode.ERROR))
        self.end()

    def end(self, default: str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        outcome = self.outcome or default
        if outcome is not None:
            self.otel.set_attribute("tokenpipe.attempt.outcome", outcome)
            if outcome in FAILED:
                self.otel.set_attribute("error.type", outcome)
                self.otel.set_status(Status(StatusCode.ERROR))
        self.otel.end()

    def headers(self) -> bytes:
        """This span's W3C trace context as request header lines, for the upstream."""
        return header_lines(self.otel.get_span_context())

    def __enter__(self) -> Span:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if e is not None:
            self.fail(e)
        else:
            self.end()


class NoSpan(Span):
    """A span that records nothing (tracing off, or a request the sampler left out)."""

    __slots__ = ("_headers",)
    on = False

    def __init__(self, headers: bytes = b"") -> None:
        self._headers = headers  # an unsampled request's context, still sent upstream

    def set(self, key: str, value: Any) -> None:
        pass

    def status(self, code: int) -> None:
        pass

    def event(self, name: str) -> None:
        pass

    def stall(self, bound: str) -> None:
        pass

    def mark(self, outcome: str) -> None:
        pass

    def fail(self, e: BaseException) -> None:
        pass

    def end(self, default: str | None = None) -> None:
        pass

    def headers(self) -> bytes:
        return self._headers

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        pass


NO_SPAN = NoSpan()


def header_lines(ctx: otel.SpanContext) -> bytes:
    if not ctx.is_valid:
        return b""
    lines = b"traceparent: 00-%032x-%016x-%02x\r\n" % (ctx.trace_id, ctx.span_id, ctx.trace_flags)
    # TraceState keeps only keys and values of W3C's grammar: no line break can get through.
    state = ctx.trace_state.to_header() if ctx.trace_state else ""
    if state:
        lines += b"tracestate: %s\r\n" % state.encode("ascii", "replace")
    return lines


@lru_cache(maxsize=256)
def server_of(url: str) -> tuple[str, int]:
    """`server.address` and `server.port` of an upstream's base URL (from the config)."""
    u = URL(url)
    return u.host or "", u.port or 0
