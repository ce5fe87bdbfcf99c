"""Moves an upstream stream to the client with bounded memory, and measures it on the way.

Two parts per stream (see `relay_stream`):
- the reader (a child task) parses upstream SSE events into `Piece`s and puts them into a
  bounded `Accumulator`, merging consecutive content deltas as they queue;
- the writer (the request's own task) takes whatever has accumulated whenever the client can
  take more and the flow gate (credit, pace) allows, and emits it as one event or message.

A client that keeps up gets every upstream event as it was sent (the bytes pass through, no
re-serialisation, no waiting for more). A slow client gets fewer, larger events with exactly
the same text. No content is dropped or reordered: merging only joins neighbouring content
deltas of the same choice.

Bounds (per stream): the accumulator stops reading the upstream once it holds HIGH_WATERMARK
bytes (TCP backpressure then reaches the upstream) and resumes below LOW_WATERMARK; one socket
read (at most aiohttp's 64 KiB read size) may land on top of the high watermark.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from tokenpipe import sse
from tokenpipe.control.flowgate import FlowGate
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics

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
        self.itl = metrics.ITL.labels(*self.labels)

    def observe_content(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
            self.ttft = now - self.started_at
            metrics.TTFT.labels(*self.labels).observe(self.ttft)
        else:
            self.itl.observe(now - self.last_token_at)
        self.last_token_at = now
        self.chunks += 1

    def finish(self, status: int) -> None:
        end = time.perf_counter()
        upstream, model = self.labels
        metrics.REQUEST_DURATION.labels(upstream, model).observe(end - self.started_at)
        metrics.REQUESTS.labels(str(status), upstream, model).inc()
        usage = self.usage
        if usage:
            prompt = usage.get("prompt_tokens") or 0
            completion = usage.get("completion_tokens") or 0
            metrics.TOKENS.labels("prompt", upstream, model).inc(prompt)
            metrics.TOKENS.labels("completion", upstream, model).inc(completion)
            if self.first_token_at is not None and completion > 1:
                tpot = (self.last_token_at - self.first_token_at) / (completion - 1)
                metrics.TPOT.labels(upstream, model).observe(tpot)


#: Bytes of queued content at which the reader stops reading the upstream.
HIGH_WATERMARK = 64 * 1024
#: Bytes of queued content below which a paused reader resumes.
LOW_WATERMARK = 16 * 1024
#: Accounting overhead per queued piece (bytes), so many tiny pieces still count.
PIECE_OVERHEAD = 64


class Piece:
    """One upstream event, or several neighbouring content deltas merged.

    `parts` (content pieces only) holds each delta's text; `template` is the first delta's
    chunk, from which a merged event is rebuilt. `raw` is the event as received (and sent when
    the piece was not merged or split).
    """

    __slots__ = ("error", "finish_reason", "parts", "raw", "size", "template", "text_key")

    def __init__(
        self,
        raw: bytes | None,
        parts: list[str] | None = None,
        template: dict[str, Any] | None = None,
        text_key: str = "",
    ) -> None:
        self.raw = raw
        self.parts = parts
        self.template = template
        self.text_key = text_key  # "content" (chat delta) or "text" (completion)
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.size = (len(raw) if raw is not None else 0) + PIECE_OVERHEAD

    @property
    def tokens(self) -> int:
        return len(self.parts) if self.parts is not None else 0

    def split(self, n: int) -> Piece:
        """Takes the first n deltas off this piece and returns them as a piece of their own."""
        assert self.parts is not None and 0 < n < len(self.parts)
        head = Piece(None, self.parts[:n], self.template, self.text_key)
        self.parts = self.parts[n:]
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
        return "text" if isinstance(choice.get("text"), str) else ""
    if len(delta) == 1 and isinstance(delta.get("content"), str):
        return "content"
    return ""


class EventParser:
    """Upstream socket reads -> pieces, recording usage and the end of the stream."""

    __slots__ = ("decoder", "strip_usage", "tally", "texts")

    def __init__(self, tally: StreamTally, strip_usage: bool) -> None:
        self.tally = tally
        #: Text of each content delta so far, when the stream may need a continuation
        #: (tail.StreamGuard.resume); None: not recorded.
        self.texts: list[str] | None = None
        #: The gateway asked the upstream for usage on the client's behalf; remove the
        #: usage-only chunk again so the client gets exactly what it asked for.
        self.strip_usage = strip_usage
        self.decoder = sse.SSEDecoder()

    def feed(self, chunk: bytes) -> list[Piece]:
        out: list[Piece] = []
        tally = self.tally
        for data, comment, _ in self.decoder.feed(chunk):
            if comment:
                out.append(Piece(b": " + data + b"\n\n"))
                continue
            if data == sse.DONE:
                tally.done = True
                out.append(Piece(sse.DONE_EVENT))
                continue
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                raise sse.SSEProtocolError("upstream sent an event that is not JSON") from None
            if type(obj) is not dict:
                raise sse.SSEProtocolError("upstream sent an event that is not a JSON object")
            if "usage" in obj:
                usage = obj["usage"]
                if usage:
                    tally.usage = usage
                if self.strip_usage:
                    if not obj.get("choices"):
                        continue  # the usage-only chunk the client did not ask for
                    # `"usage": null` is there only because we asked for usage. OpenAI-compatible
                    # servers write it compactly; cutting the bytes avoids a re-serialisation.
                    cut = data.replace(b',"usage":null', b"", 1)
                    if len(cut) == len(data):
                        del obj["usage"]
                        cut = orjson.dumps(obj)
                    else:
                        del obj["usage"]
                    data = cut
            raw = b"data: " + data + b"\n\n"
            choices = obj.get("choices")
            if choices:
                key = _mergeable(obj, choices)
                if key:
                    text = choices[0]["delta"]["content"] if key == "content" else choices[0][key]
                    if text:
                        out.append(Piece(raw, [text], obj, key))
                        if self.texts is not None:
                            self.texts.append(text)
                        continue
                piece = Piece(raw)
                if _choices_have_content(choices):
                    # Content that cannot merge (e.g. with a finish_reason): one token, as is.
                    piece.parts = [_choice_text(choices[0])]
                    if self.texts is not None:
                        self.texts.append(piece.parts[0])
                piece.finish_reason = choices[0].get("finish_reason")
                if piece.finish_reason:
                    tally.finished = True
                out.append(piece)
            else:
                piece = Piece(raw)
                err = obj.get("error")
                if isinstance(err, dict):
                    piece.error = err
                    tally.finished = True
                out.append(piece)
        return out


def _choice_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if delta is None:
        return str(choice.get("text") or "")
    return str(delta.get("content") or "")


class Accumulator:
    """The bounded queue between a stream's reader and writer (see the module docstring)."""

    #: Bytes queued in all accumulators of this process (the tokenpipe_stream_buffer_bytes gauge).
    total_bytes = 0

    __slots__ = (
        "_data",
        "_drained",
        "closed",
        "error",
        "merged",
        "paused_s",
        "pending",
        "size",
    )

    def __init__(self) -> None:
        self.pending: deque[Piece] = deque()
        self.size = 0
        self.closed = False
        self.error: GatewayError | None = None
        self.merged = 0  # deltas merged into a neighbour
        self.paused_s = 0.0  # seconds the reader waited for the writer
        self._data = asyncio.Event()
        self._drained = asyncio.Event()

    def put(self, piece: Piece) -> None:
        pending = self.pending
        # Content that queues behind content not yet sent joins it: whatever waits for the
        # client leaves as one event. Nothing waits when the client keeps up (the writer takes
        # each piece as it comes), so then events pass one for one, as the upstream sent them.
        if piece.template is not None and pending:
            last = pending[-1]
            if (
                last.template is not None
                and last.text_key == piece.text_key
                and last.parts is not None
                and piece.parts is not None
            ):
                last.parts.extend(piece.parts)
                last.raw = None
                grow = len(piece.parts[0]) + 8
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
            await self._data.wait()

    def take(self, allowed: int) -> tuple[list[Piece], int]:
        """Takes pieces from the front: pieces without tokens always, content up to `allowed`
        tokens (splitting a merged piece if need be). Returns (pieces, tokens taken)."""
        out: list[Piece] = []
        tokens = 0
        pending = self.pending
        freed = 0
        while pending:
            piece = pending[0]
            n = piece.tokens
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
    uresp: aiohttp.ClientResponse,
    parser: EventParser,
    acc: Accumulator,
    guard: StreamGuard | None = None,
) -> None:
    """The reader: upstream bytes -> pieces in the accumulator, until the stream ends.

    With a `guard` (tail control): the bytes read while racing for the first token come
    first; each read must arrive within the stall deadline; and a stream cut after content
    may continue on another upstream, whose events feed the same accumulator (the client
    sees one stream)."""
    tally = parser.tally
    error: GatewayError | None = None
    if guard is not None and guard.recorded:
        parser.texts = []
    try:
        while True:
            error, uresp = await _read_one(uresp, parser, acc, guard)
            if error is None or guard is None or tally.finished:
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
    uresp: aiohttp.ClientResponse,
    parser: EventParser,
    acc: Accumulator,
    guard: StreamGuard | None,
) -> tuple[GatewayError | None, aiohttp.ClientResponse]:
    """Reads one upstream response to its end; returns why it ended early, if it did, and
    the response it read last (a hedge or retry may have taken over before content)."""
    tally = parser.tally
    try:
        if guard is None:
            async for chunk in uresp.content.iter_any():
                for piece in parser.feed(chunk):
                    acc.put(piece)
                await acc.wait_below_low()
        else:
            if not guard.raced:
                guard.raced = True
                uresp = await guard.first_content(uresp, parser, acc)
            await _read_guarded(uresp, parser, acc, guard)
        if not tally.done:
            return GatewayError(
                502, "the upstream ended the stream early", code="upstream_stream_truncated"
            ), uresp
    except GatewayError as e:  # no first token from any attempt
        return e, uresp
    except sse.SSEProtocolError as e:
        return GatewayError(502, str(e), code="upstream_protocol_error"), uresp
    except TimeoutError:
        return GatewayError(504, "the upstream stopped sending", code="upstream_timeout"), uresp
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
        return GatewayError(
            502, "the upstream connection broke", code="upstream_stream_truncated"
        ), uresp
    return None, uresp


async def _read_guarded(
    uresp: aiohttp.ClientResponse, parser: EventParser, acc: Accumulator, guard: StreamGuard
) -> None:
    """Reads with the stall deadline on each gap between reads. Time spent waiting for a
    slow client (backpressure) is not the upstream's gap and is not counted."""
    content = uresp.content
    last = time.perf_counter()
    async with asyncio.timeout(None) as scope:
        while True:
            limit = guard.read_timeout()
            if limit is not None:
                scope.reschedule(asyncio.get_running_loop().time() + limit)
            chunk = await content.readany()
            if not chunk:
                return
            now = time.perf_counter()
            guard.gap(now - last)
            scope.reschedule(None)
            for piece in parser.feed(chunk):
                acc.put(piece)
            await acc.wait_below_low()
            last = time.perf_counter()


Emit = Callable[[list[Piece]], Awaitable[None]]


async def pump(
    acc: Accumulator, gate: FlowGate | None, emit: Emit, gate_changed: asyncio.Event | None = None
) -> GatewayError | None:
    """The writer: sends what has accumulated as the gate allows. Returns the upstream's
    error if the stream broke (after sending everything that arrived before it)."""
    while True:
        if not acc.pending:
            if acc.closed:
                if acc.merged:
                    metrics.STREAM_MERGED_DELTAS.inc(acc.merged)
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
    uresp: aiohttp.ClientResponse,
    parser: EventParser,
    emit: Emit,
    gate: FlowGate | None = None,
    gate_changed: asyncio.Event | None = None,
    guard: StreamGuard | None = None,
) -> GatewayError | None:
    """Runs reader and writer for one stream (`guard`: tail control, see read_upstream).
    The reader never outlives this call: when the writer returns, fails (client gone) or is
    cancelled, the reader is cancelled and awaited.
    (Not a TaskGroup: it would wrap the client's ConnectionResetError in an ExceptionGroup.)"""
    acc = Accumulator()
    reader = asyncio.create_task(read_upstream(uresp, parser, acc, guard))
    try:
        return await pump(acc, gate, emit, gate_changed)
    finally:
        reader.cancel()
        try:
            await reader
        except asyncio.CancelledError:
            pass
        acc.discard()


def emit_sse(
    response: Any, tally: StreamTally, drain: Callable[[], Awaitable[None]] | None = None
) -> Emit:
    """An emitter writing pieces as SSE bytes to an aiohttp StreamResponse.

    `drain` (the request writer's) waits while the socket's send buffer is over its high
    watermark: aiohttp itself checks only every 64 KiB, which would park a stale backlog of
    un-merged events in front of a slow client.
    """

    async def emit(pieces: list[Piece]) -> None:
        now = 0.0
        out = []
        for piece in pieces:
            if piece.parts:
                now = now or time.perf_counter()
                tally.observe_content(now)
                tally.deltas += len(piece.parts)
            out.append(piece.event())
        await response.write(b"".join(out))
        if drain is not None:
            await drain()

    return emit
