"""The one buffer of a stream: the bounded queue between its reader and its writer.

Bounds (per stream): the reader stops reading the upstream once the queue holds HIGH_WATERMARK
bytes (TCP backpressure then reaches the upstream) and resumes below LOW_WATERMARK; one socket
read (at most 64 KiB, upstream's READ_MAX) may land on top of the high watermark. The recovery
record (events.Record, RECORD_MAX_BYTES) is the only other per-stream store of content; both
count in the tokenpipe_stream_buffer_bytes gauge.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tokenpipe import sse
from tokenpipe.control.flowgate import FlowGate
from tokenpipe.dialects import Piece
from tokenpipe.dialects.base import PIECE_OVERHEAD
from tokenpipe.errors import GatewayError
from tokenpipe.relay.events import HELD

#: Bytes of queued content at which the reader stops reading the upstream.
HIGH_WATERMARK = 64 * 1024
#: Bytes of queued content below which a paused reader resumes.
LOW_WATERMARK = 16 * 1024
#: Writes pieces at once without waiting for the client (raises if it is gone).
WriteNow = Callable[[list[Piece]], None]


#: Most pieces one read may carry to be written by the reader; a read holding more is a backlog
#: (the reader fell behind), which queues and leaves merged.
DIRECT_MAX_PIECES = 8


class Accumulator:
    """The bounded queue between a stream's reader and writer (see the module docstring).

    It also decides who writes: while the writer is parked with nothing queued, the client's
    transport is empty and the gate allows, the reader writes the pieces itself (`deliver`),
    saving a task switch per event; otherwise they queue here for the writer.
    """

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
        "task",
        "wake",
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
        #: No writer at work: none started yet (`wake` starts it), or parked in wait_data.
        self.idle = True
        #: Called when a piece queues and no writer runs yet (relay_stream's: starts it).
        self.wake: Callable[[], None] | None = None
        self.write_error: BaseException | None = None  # a direct write failed (client gone)
        #: The reader's task (relay_stream's caller's), for the timers that cancel its reads.
        self.task: asyncio.Task[Any] | None = None
        # The writer's and the reader's wait, a future each only while one waits (an
        # asyncio.Event per side cost ~2% of a 1-token request's CPU, py-spy).
        self._data: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None

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
                self.write_now_checked(pieces)
                return False
        for piece in pieces:
            self.put(piece)
        return self.size > HIGH_WATERMARK

    def write_now_checked(self, pieces: list[Piece]) -> None:
        """The reader's direct write, once `can_write_now()` said it may (and the gate, if
        any, allowed the pieces' tokens). Raises what the write raised (the client is gone),
        kept for the writer's side too."""
        assert self.write_now is not None  # can_write_now() said so
        try:
            self.write_now(pieces)
        except Exception as e:
            self.write_error = e
            raise

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
                HELD.queued -= last.size
                raise
            if joined:
                grow = sum(map(len, piece.parts or ())) + 8 * piece.count
                last.size += grow
                self.size += grow
                HELD.queued += grow
                self.merged += 1
                return
        raw = piece.raw
        piece.size = size = (len(raw) if raw is not None else 0) + PIECE_OVERHEAD
        pending.append(piece)
        self.size += size
        HELD.queued += size
        _wake(self._data)
        if self.wake is not None:
            self.wake()

    async def wait_below_low(self) -> None:
        """Called by the reader after a read: waits while the writer is behind."""
        if self.size <= HIGH_WATERMARK:
            return
        started = time.perf_counter()
        while self.size > LOW_WATERMARK and not self.closed:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await self._drained
            finally:
                self._drained = None
        self.paused_s += time.perf_counter() - started

    def close(self, error: GatewayError | None = None) -> None:
        self.closed = True
        self.error = error
        _wake(self._data)
        _wake(self._drained)

    async def wait_data(self) -> None:
        while not self.pending and not self.closed:
            self._data = asyncio.get_running_loop().create_future()
            self.idle = True
            try:
                await self._data
            finally:
                self._data = None
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
            HELD.queued -= freed
            if self.size <= LOW_WATERMARK:
                _wake(self._drained)
        return out, tokens

    def discard(self) -> None:
        """The stream is over: forget what is queued (it ended early; the global gauge kept
        right) and its errors, whose tracebacks hold frames that hold this accumulator (a
        cycle for the garbage collector with the whole request, test_request_garbage.py)."""
        HELD.queued -= self.size
        self.size = 0
        self.pending.clear()
        self.error = self.write_error = None


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
