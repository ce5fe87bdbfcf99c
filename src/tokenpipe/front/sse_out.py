"""SSE framing toward an HTTP client: the relay's pieces as event bytes on an aiohttp
StreamResponse, with the HTTP/1.1 chunk framing of the direct write done here."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tokenpipe.dialects import Piece
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
    response: Any, writer: Any, tally: StreamTally, end: StreamEnd | None = None
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
    writer task writes everything. `end`, when given, goes before the stream's last event.
    """
    started = False

    def encode(pieces: list[Piece]) -> bytes:
        if len(pieces) == 1:
            piece = pieces[0]
            if piece.count:
                tally.observe_content(time.perf_counter())
                tally.deltas += piece.count
            if piece.end and end is not None:
                return end() + piece.event()
            return piece.event()
        now = 0.0
        out = []
        for piece in pieces:
            if piece.count:
                now = now or time.perf_counter()
                tally.observe_content(now)
                tally.deltas += piece.count
            if piece.end and end is not None:
                out.append(end())
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
