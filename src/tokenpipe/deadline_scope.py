"""A deadline on a block of a task, for the per-request hot path.

`asyncio.timeout` costs about 10 us per use here: it is pure Python, an async context manager
(two coroutines per use) with a state machine. Each request enters two such scopes (the
upstream's headers, then its first token), so this keeps asyncio's contract with one timer
handle and a plain `with`: about 3 us.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class DeadlineScope:
    """`with DeadlineScope(seconds):` inside a task raises TimeoutError when the block is still
    running after `seconds`; a cancellation from elsewhere passes through as it is (the
    task's cancel count tells them apart, as asyncio.timeout does). None: no deadline."""

    __slots__ = ("_cancelling", "_handle", "_seconds", "_task", "expired")

    def __init__(self, seconds: float | None) -> None:
        self._seconds = seconds
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self.expired = False  # the deadline struck (the block was cancelled by it)

    def __enter__(self) -> DeadlineScope:
        if self._seconds is not None:
            task = asyncio.current_task()
            if task is None:
                raise RuntimeError("DeadlineScope must be used inside a task")
            self._task = task
            self._cancelling = task.cancelling()
            loop = asyncio.get_running_loop()
            self._handle = loop.call_later(max(0.0, self._seconds), self._fire)
        return self

    def _fire(self) -> None:
        self._handle = None
        self.expired = True
        assert self._task is not None
        self._task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        elif self.expired:
            assert self._task is not None
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
