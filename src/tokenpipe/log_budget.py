"""A log line a peer can cause as often as it likes (a header out of range, a bad usage
count, a request the HTTP parser refuses), written at most `lines` times per key in each
window of `every` seconds: the lines held back meanwhile are counted, and the count is told
with the next one."""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable

from tokenpipe.clock import MONOTONIC, Clock


class LogBudget:
    """Bound: `max_keys` keys remembered, cleared past it (which lets at most `lines` extra
    lines per key through)."""

    __slots__ = ("_windows", "clock", "every", "lines", "logger", "max_keys")

    def __init__(
        self,
        logger: logging.Logger,
        every: float = 60.0,
        lines: int = 1,
        max_keys: int = 1024,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.logger = logger
        self.every = every
        self.lines = lines
        self.max_keys = max_keys
        self.clock = clock
        # key -> (its window's start, lines written in it, lines held back since the last)
        self._windows: dict[Hashable, tuple[float, int, int]] = {}

    def warning(self, key: Hashable, msg: str, *args: object) -> None:
        """`logger.warning(msg, *args)` unless `key`'s window has had its `lines`."""
        now = self.clock.now()
        start, written, held = self._windows.get(key, (-math.inf, 0, 0))
        if now - start >= self.every:
            start, written = now, 0
        if written >= self.lines:
            self._windows[key] = (start, written, held + 1)
            return
        if len(self._windows) >= self.max_keys:
            self._windows.clear()
        self._windows[key] = (start, written + 1, 0)
        more = f" ({held} more since the last line)" if held else ""
        self.logger.warning(msg + "%s", *args, more)
