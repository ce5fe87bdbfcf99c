"""Single flight: one run of a lookup per key at a time, its result shared by every caller
that asks for that key while it runs.

A cold gateway meets a burst with empty caches, and each of its first requests missed them
at once: 1,000 streams loaded the same tokenizer 1,000 times (a worker thread each) and
queued 1,000 deep on a lock for the upstream's /v1/models. The first request now starts the
lookup; the others await the same task, and all wake when it ends.

Bounds: at most one task per key, forgotten when it ends (so keys in flight are at most the
callers waiting); each caller's wait is bounded by its own deadline scope. A caller that is
cancelled leaves the task to the others (it is shielded); a task whose callers all left still
ends, and its error is retrieved here instead of logged as never retrieved.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class SingleFlight(Generic[V]):
    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: dict[Hashable, asyncio.Task[V]] = {}

    async def do(self, key: Hashable, run: Callable[[], Coroutine[Any, Any, V]]) -> V:
        """`run()`'s result: of the run in flight for `key`, else of one started now."""
        return await asyncio.shield(self.start(key, run))

    def start(self, key: Hashable, run: Callable[[], Coroutine[Any, Any, V]]) -> asyncio.Task[V]:
        """The run in flight for `key`, else one started now, without waiting for it (a
        refresh in the background: its error is retrieved, not raised to anyone)."""
        task = self._tasks.get(key)
        if task is None or task.done():  # (ended, its callback not run yet: a new run)
            task = self._tasks[key] = asyncio.create_task(run())
            task.add_done_callback(lambda t: self._ended(key, t))
        return task

    def _ended(self, key: Hashable, task: asyncio.Task[V]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]
        if not task.cancelled():
            task.exception()  # retrieved: the callers that stayed got it already

    def __len__(self) -> int:
        """Keys in flight now."""
        return len(self._tasks)
