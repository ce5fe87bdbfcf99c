"""The peak memory a call makes, traced (tracemalloc): what a test of a bound reads, since
memory is deterministic where time is not."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def peak_bytes(fn: Callable[[], T]) -> tuple[T, int]:
    """`fn()`'s result, and the most memory traced at once while it ran (bytes)."""
    tracemalloc.start()
    try:
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, peak
