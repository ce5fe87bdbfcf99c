"""A log line a peer can cause as often as it likes (a header out of range, a bad usage
count), written at most once per key per `every` seconds: the lines held back meanwhile are
counted, and the count is told with the next one."""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable

from tokenpipe.clock import MONOTONIC, Clock


class LogBudget:
    """Bound: `max_keys` keys remembered, cleared past it (which lets at most one extra line
    per key through)."""

    __slots__ = ("_last", "clock", "every", "logger", "max_keys")

    def __init__(
        self,
        logger: logging.Logger,
        every: float = 60.0,
        max_keys: int = 1024,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.logger = logger
        self.every = every
        self.max_keys = max_keys
        self.clock = clock
        self._last: dict[Hashable, tuple[float, int]] = {}  # -> (logged at, held back since)

    def warning(self, key: Hashable, msg: str, *args: object) -> None:
        """`logger.warning(msg, *args)` unless `key` had its line within `every` seconds."""
        now = self.clock.now()
        at, held = self._last.get(key, (-math.inf, 0))
        if now - at < self.every:
            self._last[key] = (at, held + 1)
            return
        if len(self._last) >= self.max_keys:
            self._last.clear()
        self._last[key] = (now, 0)
        more = f" ({held} more since the last line)" if held else ""
        self.logger.warning(msg + "%s", *args, more)
