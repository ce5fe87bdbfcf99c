"""Moves an upstream stream to the client with bounded memory, and measures it on the way.

Two parts per stream (see `relay_stream`):
- the reader (a child task) parses upstream SSE events into `Piece`s. While the client keeps
  up (nothing queued, its transport empty, the flow gate open) the reader writes them itself;
  otherwise it puts them into a bounded `Accumulator`, merging consecutive content deltas as
  they queue;
- the writer (the request's own task) takes whatever has accumulated whenever the client can
  take more and the flow gate (credit, pace) allows, and emits it as one event or message.

A client that keeps up gets every upstream event as it was sent (the bytes pass through, no
re-serialisation, no waiting for more, no task switch). A slow client gets fewer, larger
events with exactly the same text. No content is dropped or reordered: the reader writes only
when nothing is queued, and merging only joins neighbouring content deltas of one choice.

Per event the relay decodes only the fields it acts on (msgspec, typed) and parses the whole
chunk into a dict only when it merges.

Bounds (per stream): the accumulator stops reading the upstream once it holds HIGH_WATERMARK
bytes (TCP backpressure then reaches the upstream) and resumes below LOW_WATERMARK; one socket
read (at most 64 KiB, upstream/h1.py's READ_MAX) may land on top of the high watermark.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import orjson

from tokenpipe import sse
from tokenpipe.control.flowgate import FlowGate
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics
from tokenpipe.upstream.errors import UpstreamError
from tokenpipe.upstream.h1 import UpstreamProtocolError, UpstreamResponse
from tokenpipe.upstream.http import PROTOCOL_ERROR

if TYPE_CHECKING:
    from tokenpipe.tail import StreamGuard


def chunk_has_content(obj: dict[str, Any]) -> bool:
    """True if a chunk carries output: content, reasoning or a tool call (not a role-only chunk)."""
    choices = obj.get("choices")
    return _choices_have_content(choices) if choices else False


def _choices_have_content(choices: list[dict[str, Any]]) -> bool:
    for choice in choices:
        delta = choice.get("delta")
        if delta is None:  # text completion
            if choice.get("text"):
                return True
        elif (
            delta.get("content")
            or delta.get("tool_calls")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
            or delta.get("function_call")
        ):
            return True
    return False


class StreamTally:
    """What one response did, as the client saw it: first token, gaps, tokens, outcome."""

    __slots__ = (
        "chunks",
        "deltas",
        "done",
        "finished",
        "first_token_at",
        "itl",
        "labels",
        "last_token_at",
        "started_at",
        "ttft",
        "usage",
    )

    def __init__(self, upstream: str, model: str, started_at: float) -> None:
        self.labels = (upstream, model)
        self.started_at = started_at  # time.perf_counter() at request arrival
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.chunks = 0  # content events sent to the client
        self.deltas = 0  # upstream content deltas sent (several per event when merged)
        self.usage: dict[str, Any] | None = None
        self.done = False  # [DONE] seen
        self.finished = False  # a finish_reason seen
        self.ttft: float | None = None
        self.itl = metrics.child(metrics.ITL, upstream, model)

    def observe_content(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
            self.ttft = now - self.started_at
            metrics.child(metrics.TTFT, *self.labels).observe(self.ttft)
        else:
            self.itl.observe(now - self.last_token_at)
        self.last_token_at = now
        self.chunks += 1

    def finish(self, status: int) -> None:
        end = time.perf_counter()
        upstream, model = self.labels
        child = metrics.child
        child(metrics.REQUEST_DURATION, upstream, model).observe(end - self.started_at)
        child(metrics.REQUESTS, str(status), upstream, model).inc()
        usage = self.usage
        if usage:
            prompt = usage.get("prompt_tokens") or 0
            completion = usage.get("completion_tokens") or 0
            child(metrics.TOKENS, "prompt", upstream, model).inc(prompt)
            child(metrics.TOKENS, "completion", upstream, model).inc(completion)
            if self.first_token_at is not None and completion > 1:
                tpot = (self.last_token_at - self.first_token_at) / (completion - 1)
                child(metrics.TPOT, upstream, model).observe(tpot)


#: Bytes of queued content at which the reader stops reading the upstream.
HIGH_WATERMARK = 64 * 1024
#: Bytes of queued content below which a paused reader resumes.
LOW_WATERMARK = 16 * 1024
#: Accounting overhead per queued piece (bytes), so many tiny pieces still count.
PIECE_OVERHEAD = 64


class Piece:
    """One upstream event, or several neighbouring content deltas merged.

    `count` is the content deltas (tokens) it carries; `parts` their texts. `raw` is the event
    as received (and sent when the piece was not merged or split). A piece that `may_merge` is
    parsed into `template` (from which a merged event is rebuilt) only when it does merge,
    which happens only while a client is behind.
    """

    __slots__ = (
        "count",
        "error",
        "finish_reason",
        "may_merge",
        "parts",
        "raw",
        "size",
        "template",
        "text_key",
    )

    def __init__(self, raw: bytes | None, parts: list[str] | None = None) -> None:
        self.raw = raw
        self.parts = parts
        self.count = len(parts) if parts is not None else 0
        #: A one-choice content delta not yet parsed: `mergeable` parses it (`raw` is then
        #: `data: <JSON>\n\n`).
        self.may_merge = False
        self.template: dict[str, Any] | None = None
        #: Where the text is: "content" (chat delta) or "text" (completion); "" never merges.
        self.text_key = ""
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.size = (len(raw) if raw is not None else 0) + PIECE_OVERHEAD

    def mergeable(self) -> bool:
        """Parses the piece's JSON the first time it is asked (only a queued piece is).

        The typed decode that let it through skips the fields it does not act on without
        checking them; a number there out of a double's range (`1e400`) or nesting deeper
        than orjson goes only shows now. That is the upstream's broken JSON: an
        SSEProtocolError (the reader's, as for any event it cannot read). A piece that parses
        but could not be written again (nested too deep to serialise) is passed on as it came."""
        if self.may_merge:
            self.may_merge = False
            assert self.raw is not None
            try:
                obj = orjson.loads(self.raw[6:-2])
                orjson.dumps(obj)  # a merged event is rebuilt from it: it must serialise
            except orjson.JSONEncodeError:
                return False
            except (orjson.JSONDecodeError, RecursionError):
                raise sse.SSEProtocolError(_NOT_VALID_JSON) from None
            key = _mergeable(obj, obj["choices"])
            if key:
                self.template = obj
            self.text_key = key
        return self.template is not None

    def join(self, other: Piece) -> bool:
        """Appends `other`'s deltas if both are plain content deltas of the same kind. Only
        the head of a merged run is parsed (its dict is the event's template); what joins it
        adds only its text, which the typed decode already gave."""
        if not (other.may_merge or other.template is not None):
            return False
        if not (self.mergeable() and self.text_key == other.text_key):
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
        head.text_key = self.text_key
        self.parts = self.parts[n:]
        self.count -= n
        self.raw = None
        return head

    def event(self) -> bytes:
        """The SSE bytes for the client."""
        if self.raw is not None:
            return self.raw
        assert self.parts is not None and self.template is not None
        obj = self.template
        choice = obj["choices"][0]
        target = choice["delta"] if self.text_key == "content" else choice
        target[self.text_key] = "".join(self.parts)
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    @property
    def text(self) -> str:
        return "".join(self.parts) if self.parts is not None else ""


def _mergeable(obj: dict[str, Any], choices: list[dict[str, Any]]) -> str:
    """The key holding the text if this chunk is a plain content delta of one choice, else "".
    Role chunks, finish chunks, tool calls, logprobs and usage are never merged."""
    if len(choices) != 1 or obj.get("usage"):
        return ""
    choice = choices[0]
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return ""
    delta = choice.get("delta")
    if delta is None:
        return "text" if isinstance(choice.get("text"), str) and choice["text"] else ""
    if len(delta) == 1 and isinstance(delta.get("content"), str) and delta["content"]:
        return "content"
    return ""


# The fields of a streamed chunk the relay acts on, decoded (and the whole event validated as
# JSON) by msgspec in about 1 us, a third of what a dict parse plus lookups costs. Events of any
# other shape fail validation and take the general path (`EventParser._general`).
class _Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    tool_calls: Any = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    function_call: Any = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None
    logprobs: Any = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: dict[str, Any] | msgspec.UnsetType | None = msgspec.UNSET
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
UNSET = msgspec.UNSET
_NOT_VALID_JSON = "upstream sent an event that is not valid JSON"
_NULL_USAGE = b',"usage":null'


def _has_content(choices: list[_Choice]) -> bool:
    for c in choices:
        d = c.delta
        if d is None:
            if c.text:
                return True
        elif d.content or d.tool_calls or d.reasoning_content or d.reasoning or d.function_call:
            return True
    return False


class EventParser:
    """Upstream socket reads -> pieces, recording usage and the end of the stream.

    Two things stop it, and after either nothing more of the upstream's bytes becomes a piece
    (what a read held past that point is dropped, and so is every later read): a terminal event
    (`[DONE]`, or the upstream's own error event), which sets `ended`; and an event it cannot
    read (not JSON, a number out of a double's range, nesting too deep, an SSE event over its
    bound), which sets `fault`. `feed` returns the pieces before either; the reader delivers
    them and then asks `at_end()`, which raises the fault. So the client gets every event up to
    the fault in order, then the one error event, and never an event from after it."""

    __slots__ = ("decoder", "ended", "fault", "record", "strip_usage", "tally")

    def __init__(self, tally: StreamTally, strip_usage: bool) -> None:
        self.tally = tally
        #: The JSON of each content delta so far, when the stream may need a continuation
        #: (tail.StreamGuard.resume, which reads the texts back with `texts`); None: not kept.
        self.record: list[bytes] | None = None
        #: The gateway asked the upstream for usage on the client's behalf; remove the
        #: usage-only chunk again so the client gets exactly what it asked for.
        self.strip_usage = strip_usage
        self.decoder = sse.SSEDecoder()
        self.ended = False  # a terminal event was seen
        self.fault: sse.SSEProtocolError | None = None  # the first event that could not be read

    def at_end(self) -> bool:
        """True once a terminal event was seen; raises the fault once there is one."""
        if self.fault is not None:
            raise self.fault
        return self.ended

    def _fail(self, why: str) -> None:
        self.fault = sse.SSEProtocolError(why)

    def texts(self) -> list[str]:
        """The text of each content delta recorded so far (parsed only now: rarely needed).
        Empty if one of them cannot be parsed (then the stream is not continued)."""
        out = []
        try:
            for data in self.record or ():
                obj = orjson.loads(data)
                out.append(_choice_text(obj["choices"][0]))
        except (orjson.JSONDecodeError, RecursionError):
            return []
        return out

    def feed(self, chunk: bytes) -> list[Piece]:
        """The pieces of one read, up to a terminal event or a fault (see the class)."""
        if self.ended:
            return []
        if self.fault is not None:
            raise self.fault
        # Fast path: a read holding exactly one whole event of the usual shape.
        data = self.decoder.feed_one(chunk)
        if data is not None and data != sse.DONE:
            try:
                c = _decode_chunk(data)
            except (msgspec.DecodeError, RecursionError):
                pass  # another shape, or not JSON: the general path judges it
            else:
                piece = self._typed(c, data, chunk)
                return [] if piece is None else [piece]
        out: list[Piece] = []
        tally = self.tally
        for data, comment, _ in self.decoder.feed(chunk):
            if comment:  # each line of a multi-line comment stays a comment line
                out.append(Piece(b": " + data.replace(b"\n", b"\n: ") + b"\n\n"))
                continue
            if data == sse.DONE:
                tally.done = self.ended = True
                out.append(Piece(sse.DONE_EVENT))
                return out
            try:
                c = _decode_chunk(data)
            except msgspec.ValidationError:
                piece = self._general(data)  # JSON of another shape, or numbers out of range
            except (msgspec.DecodeError, RecursionError):  # not JSON, or nested too deep
                self._fail("upstream sent an event that is not JSON")
                return out
            else:
                piece = self._typed(c, _one_line(data), None)
            if self.fault is not None:
                return out
            if piece is not None:
                out.append(piece)
                if self.ended:  # the upstream's error event
                    return out
        if self.decoder.fault is not None:
            self.fault = self.decoder.fault
        return out

    def _typed(self, c: _Chunk, data: bytes, raw: bytes | None) -> Piece | None:
        """A decoded chunk -> its piece. `raw`: the event's bytes as read, if they are
        exactly `data: <data>\n\n` (saves rebuilding them)."""
        tally = self.tally
        if c.usage is not UNSET:
            if c.usage:
                tally.usage = c.usage
            if self.strip_usage:
                if not c.choices:
                    return None  # the usage-only chunk the client did not ask for
                # `"usage":null` is there only because we asked for usage. OpenAI-compatible
                # servers write it compactly after the choices; cutting the bytes saves a
                # re-serialisation.
                if raw is not None and len(cut := raw.replace(_NULL_USAGE, b"", 1)) != len(raw):
                    raw, data = cut, cut[6:-2]
                else:
                    stripped = _without_usage(data)
                    if stripped is None:
                        self._fail(_NOT_VALID_JSON)
                        return None
                    raw, data = None, stripped
        if raw is None:
            raw = b"data: " + data + b"\n\n"
        choices = c.choices
        if not choices:
            piece = Piece(raw)
            if isinstance(c.error, dict):
                piece.error = c.error
                tally.finished = self.ended = True
            return piece
        first = choices[0]
        if len(choices) == 1:
            delta = first.delta
            text = first.text if delta is None else delta.content
            if text:  # the usual chunk: one choice, plain text
                piece = Piece(raw, [text])
                if self.record is not None:
                    self.record.append(data)
                if first.finish_reason:
                    piece.finish_reason = first.finish_reason
                    tally.finished = True
                elif first.finish_reason is None and first.logprobs is None:
                    if delta is None:
                        piece.may_merge, piece.text_key = True, "text"
                    elif (
                        delta.role is None
                        and delta.tool_calls is None
                        and delta.function_call is None
                        and delta.reasoning_content is None
                        and delta.reasoning is None
                    ):
                        piece.may_merge, piece.text_key = True, "content"
                return piece
        if _has_content(choices):
            piece = Piece(raw, [_text_of(first)])
            if self.record is not None:
                self.record.append(data)
        else:
            piece = Piece(raw)
        if first.finish_reason:
            piece.finish_reason = first.finish_reason
            tally.finished = True
        return piece

    def _general(self, data: bytes) -> Piece | None:
        """A JSON event of a shape the typed decode refused: judged on the dict. Fields of
        unexpected types are passed through, not acted on."""
        tally = self.tally
        try:
            obj = orjson.loads(data)
        except (orjson.JSONDecodeError, RecursionError):  # e.g. 1e999: not a double
            self._fail(_NOT_VALID_JSON)
            return None
        if type(obj) is not dict:
            self._fail("upstream sent an event that is not a JSON object")
            return None
        data = _one_line(data)
        choices = obj.get("choices")
        if not (isinstance(choices, list) and all(type(c) is dict for c in choices)):
            choices = None
        if "usage" in obj:
            usage = obj["usage"]
            if isinstance(usage, dict) and usage:
                tally.usage = usage
            if self.strip_usage:
                if not choices:
                    return None  # the usage-only chunk the client did not ask for
                del obj["usage"]
                try:
                    data = orjson.dumps(obj)
                except orjson.JSONEncodeError:  # nested deeper than orjson writes
                    self._fail("upstream sent an event nested too deep to pass on")
                    return None
        piece = Piece(b"data: " + data + b"\n\n")
        if choices:
            try:
                if _choices_have_content(choices):
                    piece = Piece(piece.raw, [_choice_text(choices[0])])
                    if self.record is not None:
                        self.record.append(data)
            except AttributeError:  # a delta that is not an object: no content we can read
                pass
            reason = choices[0].get("finish_reason")
            if isinstance(reason, str) and reason:
                piece.finish_reason = reason
                tally.finished = True
        elif isinstance(obj.get("error"), dict):
            piece.error = obj["error"]
            tally.finished = self.ended = True
        return piece


def _one_line(data: bytes) -> bytes:
    """The data of a multi-line `data:` event (its lines joined by LF) on one line, as it is
    re-encoded under one `data: ` prefix. Called only on data that parsed as JSON, where an LF
    can only be whitespace between tokens (a raw LF in a string is not JSON)."""
    return data.replace(b"\n", b" ") if b"\n" in data else data


def _without_usage(data: bytes) -> bytes | None:
    """The chunk without its `usage`; None if orjson cannot read or write it (msgspec skips
    the fields it does not decode without checking their numbers or depth)."""
    cut = data.replace(_NULL_USAGE, b"", 1)
    if len(cut) == len(data):
        try:
            obj = orjson.loads(data)
            del obj["usage"]
            cut = orjson.dumps(obj)
        except (orjson.JSONDecodeError, orjson.JSONEncodeError, RecursionError):
            return None
    return cut


def _text_of(choice: _Choice) -> str:
    d = choice.delta
    if d is None:
        return choice.text or ""
    return d.content or ""


def _choice_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if delta is None:
        return str(choice.get("text") or "")
    return str(delta.get("content") or "")


#: Most pieces one read may carry to be written by the reader; a read holding more is a backlog
#: (the reader fell behind), which queues and leaves merged.
DIRECT_MAX_PIECES = 8


class Accumulator:
    """The bounded queue between a stream's reader and writer (see the module docstring).

    It also decides who writes: while the writer is parked with nothing queued, the client's
    transport is empty and the gate allows, the reader writes the pieces itself (`deliver`),
    saving a task switch per event; otherwise they queue here for the writer.
    """

    #: Bytes queued in all accumulators of this process (the tokenpipe_stream_buffer_bytes gauge).
    total_bytes = 0

    __slots__ = (
        "_data",
        "_drained",
        "closed",
        "error",
        "gate",
        "idle",
        "merged",
        "paused_s",
        "pending",
        "ready",
        "size",
        "write_error",
        "write_now",
    )

    def __init__(
        self,
        gate: FlowGate | None = None,
        write_now: WriteNow | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self.pending: deque[Piece] = deque()
        self.size = 0
        self.closed = False
        self.error: GatewayError | None = None
        self.merged = 0  # deltas merged into a neighbour
        self.paused_s = 0.0  # seconds the reader waited for the writer
        self.gate = gate
        #: Writes pieces to the client without waiting for it (`write_now`), and says whether
        #: it can take more (`ready`); the reader writes directly only when both are given.
        self.write_now = write_now
        self.ready = ready
        self.idle = False  # the writer is parked in wait_data with nothing pending
        self.write_error: BaseException | None = None  # a direct write failed (client gone)
        self._data = asyncio.Event()
        self._drained = asyncio.Event()

    def deliver(self, pieces: list[Piece]) -> bool:
        """The reader's hand-over: writes at once when nothing waits and the client keeps up,
        else queues (merging). True: the queue is over its high watermark, and the reader
        must `wait_below_low()` before reading on. Synchronous: it runs once per read."""
        if len(pieces) <= DIRECT_MAX_PIECES and self.can_write_now():
            gate = self.gate
            ok = True
            if gate is not None:
                tokens = 0
                for p in pieces:
                    tokens += p.count
                if tokens:
                    ok = gate.allowance()[0] >= tokens
                    if ok:
                        gate.consume(tokens)
            if ok:
                assert self.write_now is not None  # can_write_now() said so
                try:
                    self.write_now(pieces)
                except Exception as e:
                    self.write_error = e
                    raise
                return False
        for piece in pieces:
            self.put(piece)
        return self.size > HIGH_WATERMARK

    def can_write_now(self) -> bool:
        """The reader may write itself: nothing queued, the writer parked, the client ready.
        (`pending` as well as `idle`: a put wakes the writer, which is still marked idle
        until it runs; what it has to send must go first.)"""
        return (
            not self.pending
            and self.idle
            and self.write_now is not None
            and self.ready is not None
            and self.ready()
        )

    def put(self, piece: Piece) -> None:
        pending = self.pending
        # Content that queues behind content not yet sent joins it: whatever waits for the
        # client leaves as one event. Nothing waits when the client keeps up (the writer takes
        # each piece as it comes), so then events pass one for one, as the upstream sent them.
        if piece.count and pending:
            last = pending[-1]
            try:
                joined = last.count and last.join(piece)
            except sse.SSEProtocolError:
                # `last` is the broken event (parsed only now): it goes, as does what follows
                # it; the events before it are still sent, then the reader's error event.
                pending.pop()
                self.size -= last.size
                Accumulator.total_bytes -= last.size
                raise
            if joined:
                grow = sum(map(len, piece.parts or ())) + 8 * piece.count
                last.size += grow
                self.size += grow
                Accumulator.total_bytes += grow
                self.merged += 1
                return
        pending.append(piece)
        self.size += piece.size
        Accumulator.total_bytes += piece.size
        self._data.set()

    async def wait_below_low(self) -> None:
        """Called by the reader after a read: waits while the writer is behind."""
        if self.size <= HIGH_WATERMARK:
            return
        started = time.perf_counter()
        while self.size > LOW_WATERMARK and not self.closed:
            self._drained.clear()
            await self._drained.wait()
        self.paused_s += time.perf_counter() - started

    def close(self, error: GatewayError | None = None) -> None:
        self.closed = True
        self.error = error
        self._data.set()
        self._drained.set()

    async def wait_data(self) -> None:
        while not self.pending and not self.closed:
            self._data.clear()
            self.idle = True
            try:
                await self._data.wait()
            finally:
                self.idle = False

    def take(self, allowed: int) -> tuple[list[Piece], int]:
        """Takes pieces from the front: pieces without tokens always, content up to `allowed`
        tokens (splitting a merged piece if need be). Returns (pieces, tokens taken)."""
        out: list[Piece] = []
        tokens = 0
        pending = self.pending
        freed = 0
        while pending:
            piece = pending[0]
            n = piece.count
            if n and tokens + n > allowed:
                room = allowed - tokens
                if room > 0 and n > 1:
                    head = piece.split(room)
                    shrink = sum(len(p) for p in head.parts or ()) + 8 * room
                    piece.size -= shrink
                    freed += shrink
                    out.append(head)
                    tokens += room
                break
            pending.popleft()
            freed += piece.size
            out.append(piece)
            tokens += n
        if freed:
            self.size -= freed
            Accumulator.total_bytes -= freed
            if self.size <= LOW_WATERMARK:
                self._drained.set()
        return out, tokens

    def discard(self) -> None:
        """Forget what is queued (the stream ended early); keeps the global gauge right."""
        Accumulator.total_bytes -= self.size
        self.size = 0
        self.pending.clear()


metrics.STREAM_BUFFER_BYTES.set_function(lambda: Accumulator.total_bytes)


async def read_upstream(
    uresp: UpstreamResponse,
    parser: EventParser,
    acc: Accumulator,
    guard: StreamGuard | None = None,
) -> None:
    """The reader: upstream bytes -> pieces, delivered to the client or the accumulator,
    until the stream ends.

    With a `guard` (tail control): the bytes read while racing for the first token come
    first; each read must arrive within the stall deadline; and a stream cut after content
    may continue on another upstream, whose events feed the same accumulator (the client
    sees one stream)."""
    tally = parser.tally
    error: GatewayError | None = None
    if guard is not None and guard.recorded:
        parser.record = []
    try:
        while True:
            error, uresp = await _read_one(uresp, parser, acc, guard)
            # Broken bytes are not continued: the same upstream would be asked again, and what
            # the broken event held is unknown.
            if error is None or guard is None or tally.finished or error.code == PROTOCOL_ERROR:
                break
            resumed = await guard.resume(error, parser, acc, uresp)
            if resumed is None:
                break
            uresp = resumed
    finally:
        acc.close(error)
        if acc.paused_s:
            metrics.UPSTREAM_READ_PAUSED.inc(acc.paused_s)


async def _read_one(
    uresp: UpstreamResponse,
    parser: EventParser,
    acc: Accumulator,
    guard: StreamGuard | None,
) -> tuple[GatewayError | None, UpstreamResponse]:
    """Reads one upstream response to its end; returns why it ended early, if it did, and
    the response it read last (a hedge or retry may have taken over before content)."""
    try:
        if guard is None:
            async for chunk in uresp.iter_any():
                pieces = parser.feed(chunk)
                over = bool(pieces) and acc.deliver(pieces)
                if parser.at_end():
                    break
                if over:
                    await acc.wait_below_low()
        else:
            if not guard.raced:
                guard.raced = True
                uresp = await guard.first_content(uresp, parser, acc)
            await _read_guarded(uresp, parser, acc, guard)
        if not parser.ended:
            return GatewayError(
                502, "the upstream ended the stream early", code="upstream_stream_truncated"
            ), uresp
        # [DONE] (or the upstream's error event) ends the stream: whatever the upstream sends
        # after it is not waited for. Its connection goes back to the pool if the body ended.
        uresp.close()
    except GatewayError as e:  # no first token from any attempt
        return e, uresp
    except (sse.SSEProtocolError, UpstreamProtocolError) as e:
        uresp.close()
        return GatewayError(502, str(e), code=PROTOCOL_ERROR), uresp
    except TimeoutError:
        if guard is not None:  # names the bound hit: stall, read timeout or a deadline
            return guard.stall_error(), uresp
        return GatewayError(504, "the upstream stopped sending", code="upstream_timeout"), uresp
    except UpstreamError:  # the upstream connection broke (a client's write error is no
        # UpstreamError: a ConnectionResetError, aiohttp's server's included, goes on up)
        if acc.write_error is not None:
            raise  # the client is gone as well: nothing to report to it
        return GatewayError(
            502, "the upstream connection broke", code="upstream_stream_truncated"
        ), uresp
    return None, uresp


#: One read in this many adds its gap to the stall estimate: the quantiles stay the same,
#: the per-read cost of the sketch falls by as much.
GAP_SAMPLE_EVERY = 4


class StallWatch:
    """The stall deadline on each wait for an upstream read, with one timer per stream, and
    the gap samples for the stall estimate.

    A timer per read (asyncio.timeout rescheduled twice per read) costs two timer-heap
    operations per token; here a read only stamps its start (`start`), and the timer, when
    it fires, checks the read in progress and sets itself again for that read's deadline. A
    read that overruns cancels the reader, which `timed_out()` recognises.
    """

    __slots__ = ("_base", "_handle", "expired", "guard", "reading", "reads", "since", "task")

    def __init__(self, guard: StreamGuard) -> None:
        self.guard = guard
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self._base = task.cancelling()
        self._handle: asyncio.TimerHandle | None = None
        self.since = 0.0  # guard clock time the read in progress started
        self.reading = False  # the reader is waiting for the upstream
        self.reads = 0
        self.expired = False

    def start(self, now: float) -> None:
        """The reader starts waiting for the upstream."""
        self.since = now
        self.reading = True
        if self._handle is None:  # the first read, or the timer fired between reads
            self._arm()

    def arrived(self, _pieces: object = None) -> None:
        """Bytes arrived: one gap in GAP_SAMPLE_EVERY goes to the estimate, and the deadline
        runs from here (bytes pushed while the reader still waits count as a read too). Takes
        the pushed pieces, unused, so that it is the push path's `after` itself."""
        now = self.guard.now()
        self.reads += 1
        if self.reads % GAP_SAMPLE_EVERY == 1:
            self.guard.gap(now - self.since)
        self.since = now

    def _arm(self) -> None:
        delay = self.guard.read_deadline(self.since) - self.guard.now()
        # At least 1 ms: loop timers have millisecond resolution.
        self._handle = asyncio.get_running_loop().call_later(max(0.001, delay), self._fire)

    def _fire(self) -> None:
        self._handle = None
        if not self.reading:
            return  # between reads (writing, backpressure): the next read sets it again
        if self.guard.now() >= self.guard.read_deadline(self.since):
            self.expired = True
            self.task.cancel()
        else:
            self._arm()

    def timed_out(self) -> bool:
        """After a CancelledError in the reader: was it this watch's (not a real cancel)?"""
        return self.expired and self.task.uncancel() <= self._base

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


#: Largest piece of body the push path takes (bytes); a larger one is a backlog, read and
#: merged by the task.
PUSH_MAX_BYTES = 16 * 1024


def push_taker(
    uresp: UpstreamResponse,
    parser: EventParser,
    acc: Accumulator,
    after: Callable[[list[Piece]], None],
) -> Callable[[bytes], bool]:
    """The push path, for `uresp.take`: each piece of body is parsed and delivered (written
    to the client) in the loop step the HTTP parser hands it over, with no wake-up of the
    reader task, whose wake-up under load waits behind the rest of the step's work. `after`
    sees each piece's events. It declines (the task reads it) a piece over PUSH_MAX_BYTES,
    a paced or credited stream, and any piece while the client is behind.

    After the end of the stream ([DONE]) or a fault it takes every piece and drops it: the
    task is told (nudged, or given the error) and nothing of what follows reaches the client."""
    feed = parser.feed
    deliver = acc.deliver
    broken = False

    def take(data: bytes) -> bool:
        nonlocal broken
        if broken or parser.ended or parser.fault is not None:
            return True
        if len(data) > PUSH_MAX_BYTES or acc.gate is not None or not acc.can_write_now():
            return False
        try:
            pieces = feed(data)
            if pieces:
                deliver(pieces)  # written, or queued (at most one read: under the watermark)
            after(pieces)
            if parser.at_end():
                uresp.nudge()  # the task returns: the stream is over
        except Exception as e:  # the parked task raises it as if it had read the bytes itself
            broken = True
            uresp.set_exception(e)
        return True

    return take


async def _read_guarded(
    uresp: UpstreamResponse, parser: EventParser, acc: Accumulator, guard: StreamGuard
) -> None:
    """Reads with the stall deadline on each wait for the upstream. Time spent waiting for a
    slow client (backpressure) is not the upstream's gap and is not counted.

    While the client keeps up, the body is not read here at all: it is pushed (`push_taker`)
    and this task stays parked in `readany()`, woken only for what the push declines."""
    readany = uresp.readany
    watch = StallWatch(guard)
    now = guard.now
    feed = parser.feed
    deliver = acc.deliver
    uresp.take(push_taker(uresp, parser, acc, watch.arrived))
    try:
        while True:
            if parser.ended or parser.fault is not None:
                parser.at_end()  # raises the fault
                return
            watch.start(now())
            chunk = await readany()
            watch.reading = False
            if not chunk:
                if uresp.at_eof():
                    return
                continue  # a nudge: the push path ended the stream, or one left from the race
            watch.arrived()
            pieces = feed(chunk)
            if pieces and deliver(pieces):
                if parser.ended or parser.fault is not None:
                    continue  # over: no need to wait for the client first
                await acc.wait_below_low()
    except asyncio.CancelledError:
        if watch.timed_out():
            raise TimeoutError from None
        raise
    finally:
        uresp.take(None)
        watch.stop()


Emit = Callable[[list[Piece]], Awaitable[None]]
#: Writes pieces at once without waiting for the client (raises if it is gone).
WriteNow = Callable[[list[Piece]], None]


async def pump(
    acc: Accumulator, gate: FlowGate | None, emit: Emit, gate_changed: asyncio.Event | None = None
) -> GatewayError | None:
    """The writer: sends what has accumulated as the gate allows. Returns the upstream's
    error if the stream broke (after sending everything that arrived before it); raises
    what a direct write by the reader raised (the client went away)."""
    while True:
        if not acc.pending:
            if acc.closed:
                if acc.merged:
                    metrics.STREAM_MERGED_DELTAS.inc(acc.merged)
                if acc.write_error is not None:
                    raise acc.write_error
                return acc.error
            await acc.wait_data()
            continue
        if gate is None:
            allowed, wait = 1 << 30, 0.0
        else:
            allowed, wait = gate.allowance()
        pieces, tokens = acc.take(allowed)
        if pieces:
            if gate is not None:
                gate.consume(tokens)
            await emit(pieces)
            continue
        # Held back by flow control: wait for time (pace) or a change (credit, cancel).
        if gate_changed is None:
            if math.isinf(wait):
                raise AssertionError("credit mode needs a gate_changed event")
            await asyncio.sleep(wait)
        else:
            gate_changed.clear()
            try:
                await asyncio.wait_for(gate_changed.wait(), None if math.isinf(wait) else wait)
            except TimeoutError:
                pass


async def relay_stream(
    uresp: UpstreamResponse,
    parser: EventParser,
    emit: Emit,
    gate: FlowGate | None = None,
    gate_changed: asyncio.Event | None = None,
    guard: StreamGuard | None = None,
    write_now: WriteNow | None = None,
    ready: Callable[[], bool] | None = None,
) -> GatewayError | None:
    """Runs reader and writer for one stream (`guard`: tail control, see read_upstream).
    With `write_now` (writes without waiting for the client) and `ready` (the client has
    nothing waiting for it) the reader writes directly while the client keeps up (see
    Accumulator). The reader never outlives this call: when the writer returns, fails
    (client gone) or is cancelled, the reader is cancelled and awaited.
    (Not a TaskGroup: it would wrap the client's ConnectionResetError in an ExceptionGroup.)"""
    acc = Accumulator(gate, write_now, ready)
    reader = asyncio.create_task(read_upstream(uresp, parser, acc, guard))
    try:
        return await pump(acc, gate, emit, gate_changed)
    finally:
        reader.cancel()
        try:
            await reader
        except asyncio.CancelledError:
            pass
        except Exception as e:
            if e is not acc.write_error:  # that one the writer raised already
                raise
        acc.discard()


def emit_sse(
    response: Any, writer: Any, tally: StreamTally
) -> tuple[Emit, WriteNow | None, Callable[[], bool]]:
    """Emitters writing pieces as SSE bytes to a prepared aiohttp StreamResponse and its
    `writer` (`request.writer`): (emit, write_now, ready).

    `emit` (the writer task's) then waits while the socket's send buffer is over its high
    watermark: aiohttp itself checks only every 64 KiB, which would park a stale backlog of
    un-merged events in front of a slow client. `write_now` (the reader's) never waits: the
    reader must go on reading and merging while a client falls behind. It frames the HTTP/1.1
    chunk itself and hands it to the transport in one call: aiohttp's writer takes five
    Python frames and a coroutine per write for the same bytes, and this runs once per
    token. aiohttp holds the prepared headers back to send them with the first body bytes;
    a first direct write sends them itself (`StreamWriter.send_headers`), so the role chunk
    and the first token need no hop through the writer task either. `ready` says the client
    can take a direct write: the transport holds no more than its low watermark (not
    "nothing": uvloop sends what was written at the end of the loop iteration, so a buffer
    that is not empty yet does not mean a slow client; one that holds a few KiB does).
    write_now is None on a response that is not chunked (HTTP/1.0) or compressed: then the
    writer task writes everything.
    """
    started = False

    def encode(pieces: list[Piece]) -> bytes:
        if len(pieces) == 1:
            piece = pieces[0]
            if piece.count:
                tally.observe_content(time.perf_counter())
                tally.deltas += piece.count
            return piece.event()
        now = 0.0
        out = []
        for piece in pieces:
            if piece.count:
                now = now or time.perf_counter()
                tally.observe_content(now)
                tally.deltas += piece.count
            out.append(piece.event())
        return b"".join(out)

    async def emit(pieces: list[Piece]) -> None:
        nonlocal started
        await response.write(encode(pieces))
        started = True
        await writer.drain()

    transport = writer.transport

    low = transport.get_write_buffer_limits()[0] if transport is not None else 0
    # aiohttp holds the headers back until the first write and can send them alone.
    send_headers: Callable[[], None] | None = getattr(writer, "send_headers", None)

    def ready() -> bool:
        return (started or send_headers is not None) and transport.get_write_buffer_size() <= low

    chunked = response.headers.get("Transfer-Encoding") == "chunked"  # set by prepare()
    if not chunked or response.compression or transport is None:
        return emit, None, ready

    def write_now(pieces: list[Piece]) -> None:
        nonlocal started
        data = encode(pieces)
        if transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        if not started:
            assert send_headers is not None  # ready() said so
            send_headers()
            started = True
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    return emit, write_now, ready
