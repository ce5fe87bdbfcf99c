"""SSE framing toward an HTTP client: the relay's pieces as event bytes on the front's
StreamResponse (front/wire.py, which frames the HTTP/1.1 chunks)."""

from __future__ import annotations

import time
from collections.abc import Callable

from tokenpipe.dialects import Piece
from tokenpipe.front.wire import StreamResponse
from tokenpipe.observe.server_timing import Timing
from tokenpipe.relay.buffer import WriteNow
from tokenpipe.relay.stream import Emit
from tokenpipe.relay.tally import StreamTally


class StreamEnd:
    """The stream's end-of-stream timing comment (observe/server_timing.py): its bytes the
    first time it is asked, then nothing. Written before the stream's last event, so a client
    that stops reading at `[DONE]` has it."""

    __slots__ = ("sent", "tally", "timing")

    def __init__(self, tally: StreamTally, timing: Timing) -> None:
        self.tally = tally
        self.timing = timing
        self.sent = False

    def __call__(self) -> bytes:
        if self.sent:
            return b""
        self.sent = True
        t = self.tally
        return self.timing.stream_end(t.first_token_at, t.max_gap, time.perf_counter())


def emit_sse(
    response: StreamResponse, tally: StreamTally, end: StreamEnd | None = None
) -> tuple[Emit, WriteNow, Callable[[], bool]]:
    """Emitters writing pieces as SSE bytes to a prepared StreamResponse: (emit, write_now,
    ready).

    `emit` (the writer task's) waits after its write while the client's send buffer is over
    its high watermark, so a stale backlog of un-merged events never parks in front of a slow
    client. `write_now` (the reader's) never waits: the reader must go on reading and merging
    while a client falls behind; the role chunk and the first token need no hop through the
    writer task (the held head goes out with the first of them, in one write). `ready` says
    the client can take a direct write: the transport holds no more than its low watermark
    (not "nothing": uvloop sends what was written at the end of the loop iteration, so a
    buffer that is not empty yet does not mean a slow client; one that holds a few KiB does).
    `end`, when given, goes before the stream's last event.
    """

    def encode(pieces: list[Piece]) -> bytes:
        if len(pieces) == 1:
            piece = pieces[0]
            if piece.count:
                tally.observe_content(time.perf_counter(), piece.count)
            # (`raw` read here: the common case costs no `event()` call)
            raw = piece.raw if piece.raw is not None else piece.event()
            if piece.end and end is not None:
                return end() + raw
            return raw
        now = 0.0
        out = []
        for piece in pieces:
            if piece.count:
                now = now or time.perf_counter()
                tally.observe_content(now, piece.count)
            if piece.end and end is not None:
                out.append(end())
            out.append(piece.raw if piece.raw is not None else piece.event())
        return b"".join(out)

    # The stream's last event (`Piece.end`: the parser stops at it) carries the body's end.
    async def emit(pieces: list[Piece]) -> None:
        await response.write(encode(pieces), pieces[-1].end)

    transport = response.transport
    low = transport.get_write_buffer_limits()[0]
    send = response.send

    def ready() -> bool:
        return transport.get_write_buffer_size() <= low

    def write_now(pieces: list[Piece]) -> None:
        raw = pieces[0].raw if len(pieces) == 1 else None
        if raw is not None and not pieces[0].end:
            # One event as it came (a token of a client that keeps up): `encode`'s work
            # inline, one frame fewer a token.
            if n := pieces[0].count:
                tally.observe_content(time.perf_counter(), n)
            send(raw)
        else:
            send(encode(pieces), pieces[-1].end)

    return emit, write_now, ready
