"""One upstream response (upstream/h1.py): its status and headers, and its body, fed by the
connection as llhttp parses it and read by the gateway (`readany()`) or offered to a taker.

Bounds: a response buffers at most `HIGH_WATER` bytes before its connection stops reading the
socket (TCP backpressure on the upstream), and reads on again below `LOW_WATER`.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from multidict import CIMultiDict, CIMultiDictProxy

from tokenpipe.clock import Timeout
from tokenpipe.http_fields import PIECE_BYTES
from tokenpipe.upstream.errors import UpstreamTimeout

#: Buffered body bytes above which the socket stops being read, and below which it resumes
#: (aiohttp's StreamReader uses the same pair).
HIGH_WATER = 128 * 1024
LOW_WATER = 64 * 1024
#: Most bytes one `readany()` returns: what was buffered, merged, up to this much (the relay's
#: bounds count one read on top of its watermark).
READ_MAX = 64 * 1024

Taker = Callable[[bytes], bool]


class Source(Protocol):
    """What a response needs of the connection it is read from (upstream/connection.py)."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def abort(self) -> None: ...
    def finish(self) -> None: ...


class UpstreamResponse:
    """One upstream response; its body is read with `readany()` (b"" at the end) or pushed to
    a taker (`take`)."""

    __slots__ = (
        "_buffer",
        "_conn",
        "_eof",
        "_error",
        "_fatal",
        "_loop",
        "_nudged",
        "_read_timeout",
        "_size",
        "_taker",
        "_waiter",
        "headers",
        "status",
    )

    def __init__(
        self,
        conn: Source,
        status: int,
        headers: CIMultiDict[str],
        timeout: float | None,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        """`loop`: the connection's (else looked up at the first wait: a getpid system call
        in CPython 3.11)."""
        self.status = status
        self._loop = loop
        self.headers = CIMultiDictProxy(headers)
        self._conn: Source | None = conn
        self._buffer: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None  # raised once the buffered bytes are read
        self._fatal: BaseException | None = None  # raised by the next read (set_exception)
        self._waiter: asyncio.Future[None] | None = None
        self._taker: Taker | None = None
        self._nudged = False
        self._read_timeout = timeout

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("content-length")
        return int(value) if value is not None and value.isascii() and value.isdigit() else None

    # -- fed by the connection --------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        taker = self._taker
        if taker is not None and not self._buffer and taker(data):
            return
        self._buffer.append(data)
        self._size += len(data) + PIECE_BYTES
        if self._size > HIGH_WATER and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _end(self, error: BaseException | None) -> None:
        if not self._eof and error is not None:
            self._error = error
        self._eof = True
        self._conn = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the gateway ----------------------------------------------------------------

    def take(self, taker: Taker | None) -> None:
        """Offers each later piece of body to `taker` (True: taken, not buffered) while
        nothing is buffered: pieces reach the reader in the order they came."""
        self._taker = taker

    def nudge(self) -> None:
        """Makes the waiting `readany()`, or the next one, return once: with what is buffered
        by then, or b"" before the end (tell them apart with `at_eof()`). A taker's way to
        hand the reading back to the task parked in `readany()`."""
        self._nudged = True
        self._wake()

    def set_exception(self, error: BaseException) -> None:
        """Makes the next read raise `error` (a taker's failure, raised by the reader)."""
        self._fatal = error
        self._wake()

    def at_eof(self) -> bool:
        return self._eof and not self._buffer

    async def readany(self) -> bytes:
        """What is buffered (merged), waiting for some if nothing is; b"" at the end (or when
        nudged). Raises UpstreamDisconnected if the connection broke before the body ended
        (after the bytes that came before the break), UpstreamProtocolError if its framing
        broke, UpstreamTimeout if a read timeout was set and passed."""
        nudged, self._nudged = self._nudged, False
        while not self._buffer:
            if self._fatal is not None:
                raise self._fatal
            if self._error is not None:
                raise self._error
            if self._eof or nudged:
                return b""
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            try:
                if self._read_timeout is None:
                    await self._waiter
                else:
                    try:
                        with Timeout(self._read_timeout):
                            await self._waiter
                    except TimeoutError:  # only this bound's own (an outer one cancels)
                        raise UpstreamTimeout(
                            f"no body bytes from the upstream in {self._read_timeout:g} s"
                        ) from None
            finally:
                self._waiter = None
            nudged, self._nudged = self._nudged, False
        if self._fatal is not None:
            raise self._fatal
        buffer = self._buffer
        if self._size <= READ_MAX:
            data = buffer.popleft() if len(buffer) == 1 else b"".join(buffer)
            buffer.clear()
            self._size = 0
        else:
            parts: list[bytes] = []
            n = 0
            while n < READ_MAX and buffer:
                chunk = buffer.popleft()
                if n + len(chunk) > READ_MAX:
                    buffer.appendleft(chunk[READ_MAX - n :])  # a piece still: its overhead stays
                    chunk = chunk[: READ_MAX - n]
                else:
                    self._size -= PIECE_BYTES
                parts.append(chunk)
                n += len(chunk)
            data = b"".join(parts)
            self._size -= len(data)
        if self._conn is not None and self._size < LOW_WATER:
            self._conn.resume()
        return data

    @property
    def complete(self) -> bool:
        """The whole body arrived (some of it may still wait to be read)."""
        return self._eof and self._error is None

    async def iter_any(self) -> AsyncIterator[bytes]:
        while chunk := await self.readany():
            yield chunk

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.iter_any()]
        return b"".join(parts)

    def close(self, answered: bool = False) -> None:
        """Done with the response: a finished one's connection is already back in the pool;
        an unfinished one's is closed (its rest would precede the next response, and the
        upstream sees the request abandoned). `answered`: the answer's last event was read,
        only the end of the body's framing may be missing: the connection reads it and goes
        back to the pool (bounded: upstream/connection.py `finish`)."""
        self._eof = True  # first: the abort below must not record an error for this reader
        self._buffer.clear()
        self._size = 0
        # Nothing reads it after this. A raised error's traceback holds the frames that hold
        # this response: kept, it would be a cycle for the garbage collector with the whole
        # failed request (tests/test_request_garbage.py).
        self._error = self._fatal = None
        conn, self._conn = self._conn, None
        if conn is not None and answered:
            conn.finish()
        elif conn is not None:
            conn.abort()
