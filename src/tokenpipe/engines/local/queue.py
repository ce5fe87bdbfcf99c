"""Who gets the model next: a bounded queue, round-robin across clients, FIFO within one.

The model decodes one sequence at a time, so every other request waits here. Two bounds:
at most `max_waiting` requests wait (one more gets 503 + Retry-After at once), and none waits
longer than `max_wait_seconds` (then it gets 503 + Retry-After). Fairness is per client key
(`x-tokenpipe-client` header, else the peer address): a client that sends fifty requests
waits behind its own requests, not in front of everyone else's.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict, deque
from typing import Generic, TypeVar

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.errors import GatewayError

T = TypeVar("T")


class QueueFull(Exception):
    pass


class FairQueue(Generic[T]):
    """Waiting items by client. `pop` serves clients in turn (round-robin), each in FIFO order.

    Bound: `max_waiting` items in all; `push` beyond it raises `QueueFull` (nothing is dropped
    silently: the caller answers 503).
    """

    __slots__ = ("_by_client", "_n", "max_waiting")

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        # Clients in turn order; the front one is served next. Only clients with items are kept.
        self._by_client: OrderedDict[str, deque[T]] = OrderedDict()
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def push(self, client: str, item: T) -> None:
        if self._n >= self.max_waiting:
            raise QueueFull
        items = self._by_client.get(client)
        if items is None:
            items = self._by_client[client] = deque()
        items.append(item)
        self._n += 1

    def pop(self) -> T | None:
        if not self._by_client:
            return None
        client, items = next(iter(self._by_client.items()))
        item = items.popleft()
        self._n -= 1
        if items:
            self._by_client.move_to_end(client)  # its next item waits for everyone else's turn
        else:
            del self._by_client[client]
        return item

    def remove(self, client: str, item: T) -> bool:
        """Takes out an item that stopped waiting (deadline or client gone)."""
        items = self._by_client.get(client)
        if items is None or item not in items:
            return False
        items.remove(item)  # O(items of this client), which the bound keeps small
        self._n -= 1
        if not items:
            del self._by_client[client]
        return True


class ServiceTime:
    """Exponentially weighted mean of how long one request holds the model (seconds), to tell
    a rejected client when to come back."""

    __slots__ = ("alpha", "mean")

    def __init__(self, initial: float = 1.0, alpha: float = 0.2) -> None:
        self.mean = initial
        self.alpha = alpha

    def add(self, seconds: float) -> None:
        self.mean += self.alpha * (seconds - self.mean)


class ModelSlot:
    """The one model, granted to one request at a time, in `FairQueue` order.

    `acquire` returns the seconds waited; `release` hands the model straight to the next waiter
    (no thundering herd, no barging past the queue).
    """

    def __init__(self, max_waiting: int, max_wait_seconds: float, clock: Clock = MONOTONIC) -> None:
        self.queue: FairQueue[asyncio.Future[None]] = FairQueue(max_waiting)
        self.max_wait_seconds = max_wait_seconds
        self.clock = clock
        self.busy = False
        self.service = ServiceTime()
        self._granted_at = 0.0

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def retry_after(self) -> float:
        """Seconds until a new request would likely get the model: everyone ahead, served at the
        mean service time, capped by the wait deadline. At least 1 (whole seconds in the header)."""
        estimate = (self.waiting + 1) * self.service.mean
        return max(1.0, math.ceil(min(estimate, self.max_wait_seconds)))

    async def acquire(self, client: str) -> float:
        start = self.clock.now()
        if not self.busy and not self.queue:
            self._grant()
            return 0.0
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            self.queue.push(client, fut)
        except QueueFull:
            raise GatewayError(
                503,
                f"The local model is busy and {self.queue.max_waiting} requests are already "
                "waiting. Retry later.",
                code="queue_full",
                retry_after=self.retry_after(),
            ) from None
        try:
            # The deadline: asyncio.wait does not cancel `fut`, so a grant that lands at the same
            # moment as the timeout is seen (fut.done()) and kept rather than lost.
            await asyncio.wait((fut,), timeout=self.max_wait_seconds)
        except BaseException:
            # Cancelled while waiting (client gone): give back a grant that raced in, or leave.
            self._abandon(client, fut)
            raise
        if not fut.done():
            self._abandon(client, fut)
            raise GatewayError(
                503,
                f"Waited {self.max_wait_seconds:g} s for the local model without getting it. "
                "Retry later.",
                code="queue_timeout",
                retry_after=self.retry_after(),
            )
        return self.clock.now() - start

    def _abandon(self, client: str, fut: asyncio.Future[None]) -> None:
        if fut.done() and not fut.cancelled():
            self.release()  # it was granted to us: pass it on
        else:
            fut.cancel()
            self.queue.remove(client, fut)

    def _grant(self) -> None:
        self.busy = True
        self._granted_at = self.clock.now()

    def release(self) -> None:
        """Called once per grant, when the decode thread has stopped using the model."""
        self.service.add(self.clock.now() - self._granted_at)
        while True:
            fut = self.queue.pop()
            if fut is None:
                self.busy = False
                return
            if not fut.done():
                self._grant()
                fut.set_result(None)
                return
