"""Rolling latency quantiles: what this upstream and model did over the last minute.

Values go into DDSketch (relative-accuracy quantile sketch, DataDog's `ddsketch` package, the
kind that keeps at most BINS bins, collapsing the lowest): 1% relative error, mergeable. A
sliding window is a ring of `slices` sketches each covering window/slices seconds; a query
merges the live slices. The merged sketch is cached for `refresh` seconds, since values
arrive per chunk and quantiles are read per request.

A refresh (merging the slices, then the quantiles a deadline is drawn from) costs ~30 us for
the three views a request reads, and at low rates every request finds them stale: with
`defer` (the event loop's `call_soon`), a stale read returns the value drawn from the last
view and the refresh runs once the request waits (for its upstream's answer), off its way to
the upstream write.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from ddsketch import LogCollapsingLowestDenseDDSketch as Sketch

from tokenpipe.clock import MONOTONIC, Clock

#: Relative accuracy of every quantile (0.01: a reported 2.00 s is within 1.98-2.02 s).
ACCURACY = 0.01
#: Bins a sketch keeps: at 1% they span a 27,000x range of values (1.1 ms to 30 s), and
#: values below the range count in its lowest bin (deadlines read the high quantiles; 256
#: bins, a 167x range, would lift a p99 gap of 50 ms to 180 ms while a 30 s stall is in the
#: window). A dense store held a bin for every step between its smallest and largest value:
#: a value of 1 us and one of 300 s made ~1,000 bins, in each of an estimator's 7 sketches
#: (92 KiB), and a table holds 4,096 estimators (a client's model names; audit of
#: 2026-12-06). Bounded, an estimator holds at most ~51 KiB (tracemalloc). Adds and merges
#: cost the same (timeit: 0.8 us and 27 us, both kinds).
BINS = 512


class RollingQuantiles:
    __slots__ = (
        "_cache",
        "_cache_at",
        "_clock",
        "_computes",
        "_defer",
        "_memo",
        "_refreshing",
        "_slices",
        "_slices_max",
        "_width",
        "refresh",
    )

    def __init__(
        self,
        window: float = 60.0,
        slices: int = 6,
        clock: Clock = MONOTONIC,
        refresh: float = 0.25,
        defer: Callable[[Callable[[], None]], Any] | None = None,
    ) -> None:
        self._clock = clock
        self._width = window / slices  # seconds per slice
        # (slice number, sketch) oldest first; bounded: at most `slices` entries.
        self._slices: list[tuple[int, Sketch]] = []
        self._slices_max = slices
        self._cache: Sketch | None = None
        self._cache_at = -1e18
        # What was read from the cached merged view: quantiles by q, and values derived from
        # them by their key (`derived`). Cleared at each refresh; a few entries.
        self._memo: dict[Hashable, float | None] = {}
        self.refresh = refresh  # seconds a merged view is reused
        # Refreshes a stale view later (see the module); None: at once, on the read.
        self._defer = defer
        self._refreshing = False  # a deferred refresh is on its way
        # How each derived value is drawn, to draw it again at a deferred refresh. Bound:
        # the keys `derived` is called with (a deadline's rule, the hedge delay).
        self._computes: dict[Hashable, Callable[[RollingQuantiles], float]] = {}

    def add(self, value: float) -> None:
        n = int(self._clock.now() // self._width)
        slices = self._slices
        if not slices or slices[-1][0] != n:
            slices.append((n, Sketch(ACCURACY, BINS)))
            self._expire(n)
        # DDSketch's log mapping wants positive values (max() is ~700 instructions)
        slices[-1][1].add(value if value > 1e-6 else 1e-6)

    def _expire(self, n: int) -> None:
        oldest = n - self._slices_max + 1
        while self._slices and self._slices[0][0] < oldest:
            self._slices.pop(0)

    def _merged(self) -> Sketch | None:
        now = self._clock.now()
        if now - self._cache_at < self.refresh:  # an empty view (None) is kept as long
            return self._cache
        self._expire(int(now // self._width))
        if not self._slices:
            self._cache = None
        else:
            merged = Sketch(ACCURACY, BINS)
            for _, s in self._slices:
                merged.merge(s)
            self._cache = merged
        self._memo.clear()
        self._cache_at = now
        return self._cache

    def derived(self, key: Hashable, compute: Callable[[RollingQuantiles], float]) -> float:
        """`compute(self)`, kept under `key` until the merged view is refreshed (a deadline
        drawn from the quantiles is read several times a request, and changes only then)."""
        memo = self._memo
        if self._clock.now() - self._cache_at >= self.refresh:  # else the view is fresh
            if self._defer is None or (value := memo.get(key)) is None:
                self._merged()
            else:  # the last view's value now; the new one from the next read on
                if not self._refreshing:
                    self._refreshing = True
                    self._defer(self._refresh_later)
                return value
        value = memo.get(key)
        if value is None:
            memo[key] = value = compute(self)
            self._computes[key] = compute
        return value

    def _refresh_later(self) -> None:
        """The deferred refresh: the new view, and the values drawn from it by `derived`."""
        self._refreshing = False
        if self._clock.now() - self._cache_at < self.refresh:  # a read refreshed it since
            return
        self._merged()
        memo = self._memo
        for key, compute in self._computes.items():
            memo[key] = compute(self)

    @property
    def count(self) -> int:
        m = self._cache
        if self._clock.now() - self._cache_at >= self.refresh:
            m = self._merged()
        return int(m.count) if m is not None else 0

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0..1) of the window, None when it holds no value."""
        m = self._merged()
        if m is None or m.count == 0:
            return None
        memo = self._memo
        if q in memo:
            return memo[q]
        v = m.get_quantile_value(q)
        memo[q] = value = float(v) if v is not None else None
        return value
