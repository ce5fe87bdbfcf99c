"""The hot path of one stream: the push taker, the one body-reading loop, the writer (pump)
and `relay_stream`, which runs a reader in the caller's task and the writer in its own task
once something queues.

A client that keeps up gets every upstream event as it was sent (the bytes pass through, no
re-serialisation, no waiting for more, no task switch). A slow client gets fewer, larger
events with exactly the same text. No content is dropped or reordered: the reader writes only
when nothing is queued, and merging only joins neighbouring content deltas of one choice.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

from tokenpipe.control.flowgate import FlowGate
from tokenpipe.dialects import Piece
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics
from tokenpipe.relay.buffer import DIRECT_MAX_PIECES, Accumulator, WriteNow
from tokenpipe.relay.events import EventParser
from tokenpipe.relay.stall import StallWatch
from tokenpipe.upstream.h1 import UpstreamResponse

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
    write = acc.write_now_checked
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
                # Checked above, and parsing changed nothing of it: written at once (a read
                # of many events queues: at most one read, under the watermark).
                if len(pieces) <= DIRECT_MAX_PIECES:
                    write(pieces)
                else:
                    deliver(pieces)
            after(pieces)
            if (parser.ended or parser.fault is not None) and parser.at_end():  # (raises)
                uresp.nudge()  # the task returns: the stream is over
        except Exception as e:  # the parked task raises it as if it had read the bytes itself
            broken = True
            uresp.set_exception(e)
        return True

    return take


def _first_in(pieces: list[Piece]) -> bool:
    for piece in pieces:  # noqa: SIM110 (any() over a generator is two calls more)
        if piece.first:
            return True
    return False


async def read_body(
    uresp: UpstreamResponse,
    parser: EventParser,
    acc: Accumulator,
    watch: StallWatch | None = None,
    *,
    until_first: bool = False,
) -> None:
    """The one reading loop: the body of `uresp` into `acc` until the end of the stream
    (`until_first`: until its first token, an error, a finish or the end, whichever comes
    first), a fault (raised) or EOF (returns; the caller sees `parser.ended` unset).

    While the client keeps up, the body is not read here at all: it is pushed (`push_taker`)
    and this task stays parked in `readany()`, woken only for what the push declines, for the
    end, or (`until_first`) once the first token went out. Read by this task instead, the
    first token waited for a wake-up behind the rest of that loop step's work, which the
    other streams' pushed tokens fill: +15 ms at p99 TTFT with 64 paced streams
    (docs/performance.md). `watch`: the stall deadline on each wait for the upstream; time
    spent waiting for a slow client (backpressure) is not the upstream's gap."""
    readany = uresp.readany
    feed = parser.feed
    deliver = acc.deliver
    reached = False
    after: Callable[[list[Piece]], None]
    if until_first:

        def after(pieces: list[Piece]) -> None:
            nonlocal reached
            if not reached and _first_in(pieces):
                reached = True
                uresp.nudge()

    elif watch is not None:
        after = watch.arrived
    else:
        after = _nothing
    uresp.take(push_taker(uresp, parser, acc, after))
    try:
        while True:
            if parser.ended or parser.fault is not None:
                parser.at_end()  # raises the fault
                return
            if reached:
                return
            if watch is not None:
                watch.start(watch.now())
            chunk = await readany()
            if watch is not None:
                watch.reading = False
            if not chunk:
                if until_first or uresp.at_eof():
                    return  # the end, or nudged: content went out (the push path's)
                continue  # a nudge: the push path ended the stream, or one left from the race
            if watch is not None:
                watch.arrived()
            pieces = feed(chunk)
            over = bool(pieces) and deliver(pieces)
            if until_first and _first_in(pieces):
                reached = True
            if over and not (parser.ended or parser.fault is not None or reached):
                await acc.wait_below_low()
    except asyncio.CancelledError:
        if watch is not None and watch.timed_out():
            raise TimeoutError from None
        raise
    finally:
        uresp.take(None)
        if watch is not None:
            watch.stop()


def _nothing(_pieces: list[Piece]) -> None:
    return None


Emit = Callable[[list[Piece]], Awaitable[None]]


async def pump(
    acc: Accumulator, gate: FlowGate | None, emit: Emit, gate_changed: asyncio.Event | None = None
) -> GatewayError | None:
    """The writer: sends what has accumulated as the gate allows, until the reader closed
    the accumulator. Returns the upstream's error if the stream broke (after sending
    everything that arrived before it); raises what a direct write by the reader raised
    (the client went away)."""
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
            try:  # (asyncio.timeout: wait_for may lose a cancellation, see control/limiter.py)
                async with asyncio.timeout(None if math.isinf(wait) else wait):
                    await gate_changed.wait()
            except TimeoutError:
                pass


Reader = Callable[[Accumulator], Awaitable[GatewayError | None]]


class _Writer:
    """The stream's writer task (`pump`), started by the first piece that queues: a stream
    whose client keeps up is written by its reader alone and never has one (one task, its
    wake-ups and its end fewer per stream: ~6% of a 1-token request's CPU, relay_cost.py).
    If a write of the task fails (the client went away) while the reader still reads, the
    reader (the handler's task) is cancelled, and `relay_stream` raises the write's error."""

    __slots__ = ("acc", "emit", "failed", "gate", "gate_changed", "reader", "task")

    def __init__(
        self,
        acc: Accumulator,
        gate: FlowGate | None,
        emit: Emit,
        gate_changed: asyncio.Event | None,
        reader: asyncio.Task[object],
    ) -> None:
        self.acc = acc
        self.gate = gate
        self.emit = emit
        self.gate_changed = gate_changed
        self.reader = reader
        self.task: asyncio.Task[GatewayError | None] | None = None
        #: The write error that ended the task while the reader read (the reader cancelled).
        self.failed: BaseException | None = None

    def start(self) -> None:
        self.acc.wake = None
        self.acc.idle = False  # it has pieces to send: the reader queues behind them
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> GatewayError | None:
        try:
            return await pump(self.acc, self.gate, self.emit, self.gate_changed)
        except Exception as e:
            if not self.acc.closed:  # the reader is still at work: it stops
                self.failed = e
                self.reader.cancel()
            raise

    async def finish(self, error: GatewayError | None) -> GatewayError | None:
        """After the reader: what queued is sent; the write error, if one ended it, raised."""
        if self.task is None:
            if self.acc.write_error is not None:
                raise self.acc.write_error
            return error
        return await self.task

    async def stop(self) -> None:
        task = self.task
        if task is None:
            return
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved: raised already, or superseded by the reader's
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise
        except Exception:
            pass  # the stream ends anyway; what the reader raised is what counts


async def relay_stream(
    read: Reader,
    emit: Emit,
    gate: FlowGate | None = None,
    gate_changed: asyncio.Event | None = None,
    write_now: WriteNow | None = None,
    ready: Callable[[], bool] | None = None,
    task: asyncio.Task[Any] | None = None,
) -> GatewayError | None:
    """Runs a reader and the writer for one stream. `read(acc)` fills the accumulator and
    returns why the stream ended early, if it did (the router's reader: race, body, resume).
    It runs in the caller's task. With `write_now` (writes without waiting for the client)
    and `ready` (the client has nothing waiting for it) the reader writes directly while the
    client keeps up (see Accumulator); the writer task (`pump`) starts only once a piece
    queues, and never outlives this call. Raises what a write raised (the client went away)."""
    me = task or asyncio.current_task()  # `task`: the caller's, when it has it (a lookup
    assert me is not None  # costs a getpid system call in CPython 3.11)
    acc = Accumulator(gate, write_now, ready)
    acc.task = me
    writer = _Writer(acc, gate, emit, gate_changed, me)
    acc.wake = writer.start
    error: GatewayError | None = None
    try:
        try:
            error = await read(acc)
        except BaseException:  # (cancelled by the writer: its error is raised below)
            if writer.failed is None:
                raise
        finally:
            acc.close(error)
            if acc.paused_s:
                metrics.UPSTREAM_READ_PAUSED.inc(acc.paused_s)
        if writer.failed is not None:  # the writer cancelled the reader: the client is gone
            me.uncancel()
            if me.cancelling():
                raise asyncio.CancelledError
            raise writer.failed
        return await writer.finish(error)
    finally:
        # acc.wake is the writer's bound method and the writer holds acc and this task:
        # a cycle, left set when no writer started (most streams), that only the garbage
        # collector would free, with the task and everything its frames refer to (~31
        # objects a request, ~16 us a request in young collections; the pauses are
        # tokenpipe_gc_pause_seconds, the check tests/test_request_garbage.py).
        acc.wake = None
        try:
            await writer.stop()
        finally:
            acc.discard()
