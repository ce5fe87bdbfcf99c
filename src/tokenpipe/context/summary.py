"""Summaries of dropped history, cached by the hash of the history they cover.

The hash of a history prefix is chained message by message (h_i = sha256(h_{i-1} + message_i)),
so one pass over a conversation gives the hash of every prefix. On the next turn the longest
prefix that already has a summary is found, and only the messages after it are sent to the
summarising model together with that summary: each turn summarises only what is new.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson

from tokenpipe.context.tokens import message_text

SUMMARY_PREFIX = "Summary of the earlier conversation:\n"

INSTRUCTIONS = (
    "You compress chat history. Write a short summary of the conversation below that keeps "
    "every fact, name, number, decision and open question a reader needs to continue it. "
    "Write only the summary."
)
#: What the summarising call adds around the messages, as counted against its window: the
#: instructions, the label of the previous summary, and slack for role labels.
FRAME = INSTRUCTIONS + " (summary of what came before) " * 2


def prefix_hashes(messages: Sequence[dict[str, Any]]) -> list[bytes]:
    """hashes[i] covers messages[:i] (hashes[0] is the empty history)."""
    h = hashlib.sha256(b"tokenpipe-summary-v1").digest()
    out = [h]
    for m in messages:
        h = hashlib.sha256(h + orjson.dumps(m, option=orjson.OPT_SORT_KEYS)).digest()
        out.append(h)
    return out


def transcript(previous: str | None, messages: Sequence[dict[str, Any]]) -> str:
    lines = []
    if previous:
        lines.append(f"(summary of what came before) {previous}")
    for m in messages:
        lines.append(f"{m.get('role')}: {message_text(m)}")
    return "\n".join(lines)


class SummaryCache:
    """LRU map: history-prefix hash -> summary text. Bounded by `entries`; oldest dropped."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._map: OrderedDict[bytes, str] = OrderedDict()
        #: Summaries being written, so concurrent turns of one conversation share one call.
        #: Bounded by the number of requests in flight.
        self._pending: dict[bytes, asyncio.Future[str]] = {}

    def get(self, key: bytes) -> str | None:
        value = self._map.get(key)
        if value is not None:
            self._map.move_to_end(key)
        return value

    def put(self, key: bytes, value: str) -> None:
        self._map[key] = value
        self._map.move_to_end(key)
        while len(self._map) > self.entries:
            self._map.popitem(last=False)

    def __len__(self) -> int:
        return len(self._map)

    def longest(self, hashes: Sequence[bytes], upto: int) -> tuple[int, str | None]:
        """The largest i <= upto with a cached summary of messages[:i], and that summary."""
        for i in range(upto, 0, -1):
            value = self.get(hashes[i])
            if value is not None:
                return i, value
        return 0, None

    async def once(self, key: bytes, write: Callable[[], Awaitable[str]]) -> str:
        """Runs `write` for `key` unless another request is already writing it."""
        pending = self._pending.get(key)
        if pending is not None:
            try:
                return await asyncio.shield(pending)
            except asyncio.CancelledError:
                if pending.cancelled():  # the writer gave up (its deadline), not us
                    raise ValueError("the summary being written was abandoned") from None
                raise
            finally:
                # As `fut` below: the writer's exception, raised here too, holds this frame.
                del pending
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        try:
            value = await write()
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                fut.cancel()
            elif not fut.done():
                fut.set_exception(e)
                fut.exception()  # mark retrieved: waiters (if any) get it via shield
            # The future keeps the exception's traceback, which holds this frame: with `fut`
            # still in it, a cycle that held each failed summary's frames (and the answer
            # they read) until the collector ran (tests/test_request_garbage.py).
            del fut
            raise
        finally:
            self._pending.pop(key, None)
        self.put(key, value)
        fut.set_result(value)
        return value
