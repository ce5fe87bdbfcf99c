"""Push delivery of a streamed upstream body: each piece of body the HTTP parser produces goes to
a callback at once, instead of into a buffer that wakes the reading task.

Why: aiohttp hands body bytes over by buffering them in the response's StreamReader and waking
the task parked in `readany()`: a future, a task step and five Python frames per token, about
as much as all of the relay's own work per token (measured: a byte-forwarding loop on
`readany()` costs what tokenpipe's relay costs minus its parsing). No HTTP client library
offers a per-chunk callback, so this gives aiohttp's StreamReader one: the response's reader
object is switched to a subclass (same memory layout, no new fields) whose `feed_data` first
offers the bytes to the callback registered for it. The callback either takes them (then
the reading task stays parked: nothing was buffered) or declines (then they are buffered and
the task woken, exactly as before). So the task-based path stays the fallback for everything
the callback does not want: a slow client, a flow gate, a large backlog, any error.

Used by the relay's reader only while it waits in `readany()` on a plain `StreamReader`;
`attach` returns False (and changes nothing) for any other kind of body.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
from aiohttp.streams import StreamReader

#: The callback of each attached reader, by id (the reader has no room for a field of ours).
#: Bound: one entry per stream being relayed; `detach` removes it when the stream ends.
_TAKERS: dict[int, Callable[[bytes], bool]] = {}


class _PushReader(StreamReader):
    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        take = _TAKERS.get(id(self))
        # Only with nothing buffered: bytes must reach the callback in the order they came.
        if take is not None and data and not self._buffer and not self._eof and take(data):
            return False
        return super().feed_data(data, size)


def attach(resp: aiohttp.ClientResponse, take: Callable[[bytes], bool]) -> bool:
    """Offers each later piece of `resp`'s body to `take` (True: taken). False when the body
    is not a plain StreamReader (then nothing changes)."""
    content = resp.content
    if type(content) is not StreamReader:
        return False
    content.__class__ = _PushReader
    _TAKERS[id(content)] = take
    return True


def detach(resp: aiohttp.ClientResponse) -> None:
    content = resp.content
    if _TAKERS.pop(id(content), None) is not None:
        content.__class__ = StreamReader
