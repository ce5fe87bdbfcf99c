"""Upstream socket reads -> pieces: SSE framing here, each event's meaning from the dialect."""

from __future__ import annotations

from tokenpipe import sse
from tokenpipe.dialects import Dialect, Piece
from tokenpipe.observe import metrics
from tokenpipe.relay.tally import StreamTally

#: Bytes of content text one stream's recovery record may hold (about 64k tokens: more than a
#: continuation prompt fits in most windows). Past it the record is dropped, recovery is off
#: for that stream, and tokenpipe_recovery_record_dropped_total counts it.
RECORD_MAX_BYTES = 256 * 1024


#: Content deltas a record keeps as separate strings before joining them into one run. A
#: delta is its own str object, ~50 bytes over its text: a list of 1-character deltas held
#: 18 MiB for 256 KiB of text (an upstream sending such deltas, audit of 2026-12-06). Joined
#: every RECORD_RUN deltas, a record holds about its text plus RECORD_RUN objects.
RECORD_RUN = 256


class HeldBytes:
    """Bytes of stream content this process holds (the tokenpipe_stream_buffer_bytes gauge):
    queued in the streams' accumulators (relay/buffer.py) and kept in their records.

    The attributes of one instance, not of the classes themselves: a write to a class's
    attribute invalidates every attribute lookup CPython has specialised for that class (its
    version tag). The one write a request made (an accumulator's discard) cost ~12,000
    machine instructions a request in lookups that missed and specialised again: 823.9k ->
    812.0k a 1-token request without it (benchmarks/request_instructions.py)."""

    __slots__ = ("queued", "recorded")

    def __init__(self) -> None:
        self.queued = 0
        self.recorded = 0


HELD = HeldBytes()
metrics.STREAM_BUFFER_BYTES.set_function(lambda: HELD.queued + HELD.recorded)


class Record:
    """The content deltas so far, for a continuation after a cut (router's resume): their
    text, in joined runs, and how many there were. Bounded by RECORD_MAX_BYTES; its bytes
    count in the stream buffer gauge (HELD.recorded)."""

    __slots__ = ("deltas", "runs", "size", "tail")

    def __init__(self) -> None:
        self.runs: list[str] = []  # joined runs of RECORD_RUN deltas
        self.tail: list[str] = []  # the deltas since the last run
        self.deltas = 0
        self.size = 0

    def add(self, parts: list[str]) -> bool:
        """Keeps `parts`; False when that would pass the bound (the record is then spent).
        An empty text (a reasoning or tool-call delta) counts as 1: it is a token for the
        continuation's remainder, and counted as 0 an upstream's endless empty deltas grew
        the list without bound."""
        grow = 0
        for p in parts:
            grow += len(p) or 1
        if self.size + grow > RECORD_MAX_BYTES:
            self.clear()
            metrics.RECOVERY_RECORD_DROPPED.inc()
            return False
        tail = self.tail
        tail.extend(parts)
        if len(tail) >= RECORD_RUN:
            self.runs.append("".join(tail))
            self.tail = []
        self.deltas += len(parts)
        self.size += grow
        HELD.recorded += grow
        return True

    def text(self) -> str:
        return "".join(self.runs) + "".join(self.tail)

    def clear(self) -> None:
        HELD.recorded -= self.size
        self.size = self.deltas = 0
        self.runs = []
        self.tail = []


class EventParser:
    """Upstream socket reads -> pieces, recording usage and the end of the stream.

    Two things stop it, and after either nothing more of the upstream's bytes becomes a piece
    (what a read held past that point is dropped, and so is every later read): a terminal event
    (`[DONE]`, the upstream's own error event, the API's own last event), which sets `ended`;
    and an event it cannot read (not JSON, a number out of a double's range, nesting too deep,
    an SSE event over its bound, a value of a type the dialect does not expect), which sets
    `fault`. `feed` returns the pieces before either; the reader delivers them and then asks
    `at_end()`, which raises the fault. So the client gets every event up to the fault in
    order, then the one error event, and never an event from after it."""

    __slots__ = (
        "decoder",
        "dialect",
        "ended",
        "fault",
        "named",
        "raw_named",
        "read",
        "record",
        "strip_usage",
        "tally",
    )

    def __init__(self, tally: StreamTally, strip_usage: bool, dialect: Dialect) -> None:
        self.tally = tally
        self.dialect = dialect
        self.read = dialect.read
        self.named = dialect.named
        self.raw_named = dialect.raw_named
        #: The content so far, when the stream may need a continuation; None: not kept.
        self.record: Record | None = None
        #: The gateway asked the upstream for usage on the client's behalf; the dialect removes
        #: the usage again so that the client gets exactly what it asked for.
        self.strip_usage = strip_usage
        self.decoder = sse.SSEDecoder()
        self.ended = False  # a terminal event was seen
        self.fault: sse.SSEProtocolError | None = None  # the first event that could not be read

    def at_end(self) -> bool:
        """True once a terminal event was seen; raises the fault once there is one."""
        if self.fault is not None:
            raise self.fault
        return self.ended

    def recorded(self) -> tuple[str, int]:
        """The content so far and its number of deltas (("", 0) when not recorded, or the
        record is spent)."""
        r = self.record
        return (r.text(), r.deltas) if r is not None and r.deltas else ("", 0)

    def close(self) -> None:
        """The stream is over: its record goes (and leaves the gauge), and so does its fault,
        whose traceback holds frames that hold this parser (a cycle for the garbage collector
        with the whole failed request, tests/test_request_garbage.py)."""
        if self.record is not None:
            self.record.clear()
            self.record = None
        self.fault = None

    def feed(self, chunk: bytes) -> list[Piece]:
        """The pieces of one read, up to a terminal event or a fault (see the class)."""
        if self.ended:
            return []
        if self.fault is not None:
            raise self.fault
        named = self.named
        if named:  # an API whose events are named: that split first (a token's read too)
            events = self.decoder.feed_named(chunk, self.raw_named)
            if events is not None:
                return self._read_named(events)
        # Fast path: a read holding exactly one whole `data:` event (what LLM servers send).
        elif (data := self.decoder.feed_one(chunk)) is not None:
            try:
                piece = self.read(data, None, chunk, self.strip_usage)
            except sse.SSEProtocolError as e:
                self.fault = e
                return []
            except sse.SHAPE_ERRORS as e:
                self.fault = sse.shape_error(e)
                return []
            if piece is None:
                return []
            # A plain content delta, not recorded, has nothing to book (most events).
            if (
                piece.usage is not None
                or piece.finish_reason
                or piece.end
                or self.record is not None
            ) and not self._took(piece):
                return []
            return [piece]
        out: list[Piece] = []
        # Several whole `data:` events (a read that caught up): split at once.
        datas = self.decoder.feed_many(chunk)
        if datas is not None:
            for data in datas:
                if not self._read(data, None, out):
                    break
            return out
        if not named and (events := self.decoder.feed_named(chunk, self.raw_named)) is not None:
            return self._read_named(events)
        for data, comment, event in self.decoder.feed(chunk):
            if comment:  # each line of a multi-line comment stays a comment line
                out.append(Piece(b": " + data.replace(b"\n", b"\n: ") + b"\n\n"))
            elif not self._read(data, event, out):
                return out
        if self.decoder.fault is not None:
            self.fault = self.decoder.fault
        return out

    def _read_named(self, events: list[tuple[bytes, str, bytes | None]]) -> list[Piece]:
        """The pieces of a read of whole named events (`SSEDecoder.feed_named`)."""
        out: list[Piece] = []
        for data, name, raw in events:
            if not self._read(data, name, out, raw):
                break
        return out

    def _read(
        self, data: bytes, event: str | None, out: list[Piece], raw: bytes | None = None
    ) -> bool:
        """One event of a read of several: its piece, if any, onto `out` (`raw`: its bytes
        as read, as `Dialect.read` takes them). False: the stream stops here (a terminal
        event, or a fault: `feed` says what follows)."""
        try:
            piece = self.read(data, event, raw, self.strip_usage)
        except sse.SSEProtocolError as e:
            self.fault = e
            return False
        except sse.SHAPE_ERRORS as e:
            self.fault = sse.shape_error(e)
            return False
        if piece is None:
            pass
        elif (
            piece.usage is None
            and not piece.finish_reason
            and not piece.end
            and self.record is None
        ) or self._took(piece):
            out.append(piece)
        return not self.ended

    def _took(self, piece: Piece) -> bool:
        """Books what the piece says; False: it is not passed on."""
        if piece.count and self.record is not None:
            assert piece.parts is not None
            if not self.record.add(piece.parts):
                self.record = None
        if piece.usage is not None or piece.finish_reason or piece.end:
            tally = self.tally
            tally.trace.saw(piece.raw, piece.finish_reason)  # (traced only) model, finish
            if piece.usage:
                tally.usage = piece.usage
            if piece.error is not None or piece.finish_reason:
                tally.finished = True
            if piece.end:
                self.ended = True
                tally.done = piece.error is None
            if piece.hidden:
                return False
        return True
