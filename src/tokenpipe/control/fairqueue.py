"""The requests waiting for an upstream's capacity (control/limiter.py serves them).

They queue per API key, first come first served within a key, and the keys take turns: a key
that sends a thousand requests delays another key's next request by at most one turn. A
waiter that gave up (its future done) is dropped when its turn comes. Bound: the limiter's
`max_waiting`, checked against `waiting` before a push.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class Waiter:
    key: str
    tokens: float
    future: asyncio.Future[Any] = field(repr=False)  # the limiter's Permit, once granted


class FairQueue:
    __slots__ = ("_queues", "_turns", "waiting")

    def __init__(self) -> None:
        self._queues: dict[str, deque[Waiter]] = {}
        self._turns: deque[str] = deque()  # keys with waiters, in the order they are served
        self.waiting = 0

    def push(self, w: Waiter, front: bool = False) -> None:
        """`front`: at the head of its key's queue (the place a refused request had)."""
        q = self._queues.get(w.key)
        if q is None:
            q = self._queues[w.key] = deque()
            self._turns.append(w.key)
        if front:
            q.appendleft(w)
        else:
            q.append(w)
        self.waiting += 1

    def head(self) -> Waiter | None:
        """The head waiter of the key whose turn it is (dropping ones that gave up)."""
        while self._turns:
            key = self._turns[0]
            q = self._queues[key]
            while q and q[0].future.done():
                q.popleft()
                self.waiting -= 1
            if q:
                return q[0]
            self._turns.popleft()
            del self._queues[key]
        return None

    def served(self) -> None:
        """Removes the head waiter (`head()`) and passes the turn to the next key."""
        key = self._turns.popleft()
        q = self._queues[key]
        q.popleft()
        self.waiting -= 1
        if q:
            self._turns.append(key)
        else:
            del self._queues[key]

    def cancel_all(self) -> None:
        for q in self._queues.values():
            for w in q:
                w.future.cancel()
        self._queues.clear()
        self._turns.clear()
        self.waiting = 0
