"""The bounded hand-off from the decode thread to the event loop.

Written by hand because no library joins a blocking producer thread to an asyncio consumer with
a bound *and* a cancel that wakes the blocked producer (janus has the bound but not the wake-up,
and its per-item locking costs more than this: one semaphore operation and one
`call_soon_threadsafe` per token).

Bound: `capacity` pieces decoded but not yet taken by the consumer. When it is reached, `put`
blocks the decode thread, so the model stops decoding until the consumer (the HTTP handler, which
takes the next piece only after the socket accepted the last) catches up. A pause longer than
`max_pause` seconds gives up (`PauseTimeout`): a client that stopped reading must not hold the
one model forever. `close()` wakes a blocked `put` at once, so a cancelled request stops
decoding after the token being computed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Generic, TypeVar

T = TypeVar("T")


class PauseTimeout(Exception):
    pass


class TokenHandoff(Generic[T]):
    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int, max_pause: float) -> None:
        self._loop = loop
        self._free = threading.Semaphore(capacity)
        # Unbounded type, bounded in use: at most `capacity` pieces plus one `end` item, since
        # every `put` first takes a slot from `_free`.
        self._items: asyncio.Queue[T] = asyncio.Queue()
        self._closed = threading.Event()
        self.max_pause = max_pause
        #: time.monotonic() at which the decode thread started waiting for the consumer, or None.
        self.paused_since: float | None = None
        #: Seconds the decode thread spent waiting for the consumer, in all.
        self.paused_total = 0.0

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # -- decode thread ---------------------------------------------------------------------

    def put(self, item: T) -> bool:
        """Blocks while `capacity` pieces are untaken. False once the consumer has closed."""
        if not self._free.acquire(blocking=False):
            since = self.paused_since = time.monotonic()
            got = self._free.acquire(timeout=self.max_pause)
            self.paused_since = None  # before adding to the total: readers never count twice
            self.paused_total += time.monotonic() - since
            if not got and not self._closed.is_set():
                raise PauseTimeout(f"the client read nothing for {self.max_pause:g} s")
        if self._closed.is_set():
            return False
        return self._send(item)

    def end(self, item: T) -> None:
        """The last item (result or error); takes no slot, so it never blocks."""
        self._send(item)

    def _send(self, item: T) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self._closed.set()
            return False
        return True

    # -- event loop ------------------------------------------------------------------------

    async def get(self) -> T:
        item = await self._items.get()
        self._free.release()
        return item

    def get_nowait(self) -> T | None:
        """The next piece if one is already here (to batch several into one write)."""
        try:
            item = self._items.get_nowait()
        except asyncio.QueueEmpty:
            return None
        self._free.release()
        return item

    def close(self) -> None:
        """The consumer is gone: the decode thread stops at its next `put`, or now if blocked."""
        if not self._closed.is_set():
            self._closed.set()
            self._free.release()
