"""The seam between the API-neutral stream machinery and one API's events.

A `Piece` is one upstream event as the relay handles it (or several neighbouring content
deltas merged); a `Dialect` reads events into pieces and answers the questions the relay and
the router ask of an API. Both are plain classes: a dialect is usually one shared object per
API, stateless, so one instance serves every request; one that translates or numbers events
is made per request (`events`).
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenpipe import sse
from tokenpipe.dialects.event_json import MAX_TEMPLATE_BYTES
from tokenpipe.errors import GatewayError
from tokenpipe.settings import UpstreamSettings

#: Accounting overhead per queued piece (bytes), so many tiny pieces still count.
PIECE_OVERHEAD = 64


class Piece:
    """One upstream event, or several neighbouring content deltas merged.

    `count` is the content deltas (tokens) it carries; `parts` their texts. `raw` is the event
    as received (and sent when the piece was not merged or split). A piece that `may_merge` is
    parsed (`dialect.template`) into `template`, from which a merged event is rebuilt, only
    when it does merge, which happens only while a client is behind. `kind` says what merges
    with what (the dialect's name for "a plain text delta of this block"); "" never merges.

    What the event says besides its text, for the relay's bookkeeping: `usage` (the counts
    the upstream sent, in OpenAI's shape: `prompt_tokens`, `completion_tokens`; a dialect of
    another API translates its own, since quotas and metrics count these), `finish_reason`,
    `error` (the upstream's own error event), `end` (the last event of the stream: `[DONE]`,
    an error event, or the API's own terminal event); `hidden`: it is not passed on (a usage
    chunk the gateway asked for itself). `size`: the bytes it counts for while queued (its
    event's and PIECE_OVERHEAD), set when it queues.
    """

    __slots__ = (
        "count",
        "dialect",
        "end",
        "error",
        "finish_reason",
        "hidden",
        "kind",
        "may_merge",
        "parts",
        "raw",
        "size",
        "template",
        "usage",
    )
    size: int  # (an annotation only: set when the piece queues)

    def __init__(self, raw: bytes | None, parts: list[str] | None = None) -> None:
        self.raw = raw
        self.parts = parts
        self.count = len(parts) if parts is not None else 0
        #: A content delta not yet parsed: `mergeable` parses it with `dialect`.
        self.may_merge = False
        self.dialect: Dialect | None = None
        self.template: Any = None
        self.kind = ""
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self.end = False
        #: Carries only facts for the relay (usage), nothing for the client.
        self.hidden = False
        # `size` (its bytes and PIECE_OVERHEAD) is set when it queues (relay/buffer.py):
        # most pieces never do.

    def mergeable(self) -> bool:
        """Parses the piece the first time it is asked (only a queued piece is). May raise
        sse.SSEProtocolError: the dialect's typed read skips fields it does not act on, and a
        broken value there shows only now (see the dialect's `template`). An event over
        MAX_TEMPLATE_BYTES is not parsed (its cost: event_json.py) and never merges."""
        if self.may_merge:
            self.may_merge = False
            assert self.raw is not None and self.dialect is not None
            found = None
            if len(self.raw) <= MAX_TEMPLATE_BYTES:
                found = self.dialect.template(self.raw)
            if found is not None:
                self.template, self.kind = found
            else:
                self.kind = ""
        return self.template is not None

    def join(self, other: Piece) -> bool:
        """Appends `other`'s deltas if both are plain content deltas of the same kind. Only
        the head of a merged run is parsed (its template is the event's); what joins it adds
        only its text, which the dialect's read already gave."""
        if not (other.may_merge or other.template is not None):
            return False
        if not (self.mergeable() and self.kind == other.kind):
            return False
        assert self.parts is not None and other.parts is not None
        self.parts.extend(other.parts)
        self.count += other.count
        self.raw = None
        return True

    def split(self, n: int) -> Piece:
        """Takes the first n deltas off this (merged) piece and returns them as a piece."""
        assert self.parts is not None and 0 < n < self.count
        head = Piece(None, self.parts[:n])
        head.template = self.template
        head.kind = self.kind
        head.dialect = self.dialect
        self.parts = self.parts[n:]
        self.count -= n
        self.raw = None
        return head

    def event(self) -> bytes:
        """The SSE bytes for the client."""
        if self.raw is not None:
            return self.raw
        assert self.parts is not None and self.dialect is not None
        return self.dialect.render(self.template, self.kind, "".join(self.parts))

    @property
    def text(self) -> str:
        return "".join(self.parts) if self.parts is not None else ""

    @property
    def first(self) -> bool:
        """This event ends the wait for the first token: content, an error, a finish, the end
        (what a hedge races for and the TTFT deadline bounds)."""
        return bool(self.count or self.end or self.error is not None or self.finish_reason)


class Dialect:
    """One API's events, for the relay and the router. Subclasses implement every method.

    `name` is the client's API (translations keep it); `api` the upstream API its requests
    go to (`upstreams[].api`: only such upstreams are candidates); `path` the upstream path.
    """

    name = ""
    api = "openai"
    path = ""
    #: It generates tokens (an embedding does not: admission reserves no output for it).
    output = True
    #: The upstream's API names its events (`event:` lines: Messages, Responses): the parser
    #: tries their split first, before the `data:`-only ones (~0.35 us a token, of ~2.4).
    named = False
    #: `read` takes a named event's `raw` (`event: <event>\ndata: <data>\n\n`) and passes it
    #: on as it came. Else a named event comes with `raw` None (chat's dialect writes its
    #: events without the `event:` line, which the SDKs would read as another kind of event).
    raw_named = False

    @property
    def label(self) -> str:
        """The request metrics' `api` label, one of observe/metrics.APIS: the client's API
        (a route of another API's family overrides it: count_tokens counts as messages)."""
        return self.name

    def read(
        self, data: bytes, event: str | None, raw: bytes | None, strip_usage: bool
    ) -> Piece | None:
        """One SSE event -> its piece; None: nothing to pass on. `raw` is the event's bytes as
        read when they are exactly `data: <data>\\n\\n` (`event` None) or, for a dialect
        that is `raw_named`, `event: <event>\\ndata: <data>\\n\\n` (saves rebuilding them);
        `strip_usage`: the gateway asked for usage on the client's behalf, remove it again. Raises
        sse.SSEProtocolError for an event that cannot be read (the stream then ends with one
        protocol error)."""
        raise NotImplementedError

    def upstream_request(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """The request as the upstream's API writes it, when that differs from the client's
        (a translating dialect); None: `request` goes as it is. Raises GatewayError 400
        naming the field for what the upstream's API cannot express."""
        return None

    # -- what the client gets besides the relayed events --------------------------------------

    #: A non-streamed 200 answer goes to the client as the upstream sent it (`answer` returns
    #: `body`), so the front reads only its `usage` of it (front/answer.py). A translating
    #: dialect sets False: its answers are parsed whole, within a smaller bound.
    answers_as_sent = True

    def parse_answer(self, body: bytes) -> Any:
        """A translation's non-streamed 200 answer as `answer` reads it: parsed whole here; a
        translation reads only its fields (event_json.py). None: not JSON. Raises
        sse.SSEProtocolError when the answer cannot be read."""
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:  # (orjson's depth limit makes deep nesting one)
            return None

    def answer(self, body: bytes, obj: dict[str, Any]) -> bytes:
        """The client's body for a non-streamed 200 answer whose JSON is `obj` (`body` as the
        upstream sent it): passed through unchanged by a native dialect; a translating one
        (`answers_as_sent` False) writes the client's API here."""
        return body

    def usage_of(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The usage of a non-streamed answer, in OpenAI's shape (see Piece.usage)."""
        usage = obj.get("usage")
        return usage if isinstance(usage, dict) else None

    def error_body(self, error: GatewayError) -> bytes:
        """The JSON body of an error answer in this API's shape (OpenAI's by default)."""
        return error.json()

    def upstream_error_body(self, status: int, obj: Any) -> bytes | None:
        """The client's body for an upstream error answer whose JSON is `obj` (None: already
        in the client's shape, or not JSON: passed on as it is, see front/answer.py)."""
        return None

    def error_event(self, error: GatewayError) -> bytes:
        """The SSE event for an error after the stream started (its last event)."""
        return sse.encode(self.error_body(error))

    def for_stream(self) -> Dialect:
        """The dialect the relayed stream is read with: `self` for an API whose events each
        say all they mean; a dialect with per-stream state (Anthropic's usage spread over
        `message_start` and `message_delta`; a translation's open blocks and numbering) gives
        each stream a reader of its own. The router also reads the first events of hedges and
        retries with the request's own dialect (`read`, to find their first token) before the
        relay takes them over: that dialect's state must not be the one the relay uses."""
        return self

    def template(self, raw: bytes) -> tuple[Any, str] | None:
        """A content piece's event parsed for merging: (template, kind), or None when it is
        not a plain text delta after all. Raises sse.SSEProtocolError for broken JSON."""
        raise NotImplementedError

    def render(self, template: Any, kind: str, text: str) -> bytes:
        """The SSE bytes of a merged piece: `template` carrying `text`."""
        raise NotImplementedError

    def strip_extensions(self, request: dict[str, Any]) -> bool:
        """Removes tokenpipe's own fields from a stream request (the relay acts on them;
        upstreams would reject them). True if the request changed."""
        return False

    def wants_usage(self, request: dict[str, Any]) -> bool:
        """The client asked for usage in the stream (or the API always sends it)."""
        return True

    def ask_usage(self, request: dict[str, Any]) -> None:
        """Asks for usage in the stream on the client's behalf (`read` with strip_usage
        removes it again)."""

    def continuable(self, request: dict[str, Any]) -> bool:
        """Can a stream of this request, cut after content, continue elsewhere?"""
        return False

    def continues_on(self, upstream: UpstreamSettings) -> bool:
        """Can this upstream continue such a stream (some APIs need the upstream's help)?"""
        return True

    def continuation(self, request: dict[str, Any], text: str, deltas: int) -> bytes:
        """The request that continues `request` after `deltas` content deltas whose text is
        `text`."""
        raise NotImplementedError
