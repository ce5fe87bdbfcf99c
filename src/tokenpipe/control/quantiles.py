"""Rolling latency quantiles: what this upstream and model did over the last minute.

Values are kept as DDSketch keeps them (DataDog's `ddsketch` package: a logarithmic key
mapping at 1% relative error, and a dense store of at most BINS bins that collapses its
lowest). A sliding window is a ring of `slices` stores, each covering window/slices seconds.

Quantiles are read from a view of the window, kept for `refresh` seconds (values arrive per
chunk, quantiles are read per request). The view holds the running totals of the stores'
bins: one for the slices that are over (merged by ddsketch once they are, every
window/slices seconds) and one for the slice still filling; a quantile is a binary search
over their sum, the key whose running total first passes its rank (ddsketch's own rule, so
its own answer: tested). A refresh with the three quantiles a request reads costs 12-29
us, by how widely the values spread. Merging every slice into a new sketch and walking its
bins in Python (ddsketch's `merge` and `get_quantile_value`) cost 45-254 us (115 for values
spread as TTFTs are), and below a few hundred requests a second each view is refreshed
four times a second: at 20 a second, three views cost ~70 us a request (a 1-token request
costs ~240 us of a busy gateway's CPU); 12 us now (benchmarks/quantile_refresh.py).

At low rates every request finds the view stale: with `defer` (the event loop's
`call_soon`), a stale read returns the value drawn from the last view and the refresh runs
once the request waits (for its upstream's answer), off its way to the upstream write.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Sequence
from itertools import accumulate
from math import ceil, log, log1p
from typing import Any

from ddsketch.mapping import LogarithmicMapping
from ddsketch.store import CollapsingLowestDenseStore as Store

from tokenpipe.clock import MONOTONIC, Clock

#: Relative accuracy of every quantile (0.01: a reported 2.00 s is within 1.98-2.02 s).
ACCURACY = 0.01
#: Bins a store keeps: at 1% they span a 27,000x range of values (1.1 ms to 30 s), and
#: values below the range count in its lowest bin (deadlines read the high quantiles; 256
#: bins, a 167x range, would lift a p99 gap of 50 ms to 180 ms while a 30 s stall is in the
#: window). A store without a bound held a bin for every step between its smallest and
#: largest value: a value of 1 us and one of 300 s made ~1,000 bins, in each of an
#: estimator's 7 sketches (92 KiB), and a table holds 4,096 estimators (a client's model
#: names; audit of 2026-12-06). Bounded, an estimator holds ~50 KiB for a few values each
#: slice, ~125 KiB at most, every bin of every slice counting (tracemalloc: a counted bin
#: is a float object of its own).
BINS = 512
#: Values to keys and back, as `LogCollapsingLowestDenseDDSketch(ACCURACY)` maps them.
MAPPING = LogarithmicMapping(ACCURACY)
#: `MAPPING.key(v)` is `ceil(log(v, 2) * _PER_OCTAVE)`, computed as it computes it (tested
#: against it). Inline, a value is added in 0.6 us, not 0.7 (ddsketch's own add: 0.9); a
#: stream adds the gap of one read in four (relay/stall.py).
_PER_OCTAVE = 1 / log1p(2 * ACCURACY / (1 - ACCURACY)) * log(2)
#: The key of the smallest value kept (1 us): the log mapping wants positive values.
_KEY_FLOOR = MAPPING.key(1e-6)
#: A view's part: the key of its first bin and the running totals of its bins from there.
Part = tuple[int, Sequence[float]]


def _part(store: Store, kept: bool) -> Part:
    """The running totals of a store's bins, from its lowest key (where a collapsed store
    counts what lies below it) to its highest. A list is built in half the time (5 us for
    220 bins), an array holds a quarter of the bytes (8 a bin, not a float object's 32): the
    part `kept` for the slices that are over is an array, built once a slice."""
    start = store.min_key - store.offset
    totals = accumulate(store.bins[start : start + store.max_key - store.min_key + 1])
    return store.min_key, array("d", totals) if kept else list(totals)


class RollingQuantiles:
    __slots__ = (
        "_clock",
        "_closed",
        "_closed_span",
        "_computes",
        "_count",
        "_defer",
        "_hi",
        "_lo",
        "_memo",
        "_parts",
        "_refreshing",
        "_slices",
        "_slices_max",
        "_view_at",
        "_width",
        "key",
        "refresh",
    )

    def __init__(
        self,
        window: float = 60.0,
        slices: int = 6,
        clock: Clock = MONOTONIC,
        refresh: float = 0.25,
        defer: Callable[[Callable[[], None]], Any] | None = None,
        key: Any = None,
    ) -> None:
        #: What it estimates, as its owner names it (the router policy's table key).
        self.key = key
        self._clock = clock
        self._width = window / slices  # seconds per slice
        # (slice number, store) oldest first; bounded: at most `slices` entries.
        self._slices: list[tuple[int, Store]] = []
        self._slices_max = slices
        # The view: its parts (at most two: the slices that are over, the one filling), the
        # values they count, the range of keys they span, and when it was taken.
        self._parts: tuple[Part, ...] = ()
        self._count = 0.0
        self._lo = self._hi = 0
        self._view_at = -1e18
        # The part for the slices that are over, and which they were (first, last number).
        self._closed: Part | None = None
        self._closed_span: tuple[int, int] | None = None
        # What was read from the view: quantiles by q, and values derived from them by
        # their key (`derived`). Cleared at each refresh; a few entries.
        self._memo: dict[Hashable, float | None] = {}
        self.refresh = refresh  # seconds a view is reused
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
            slices.append((n, Store(BINS)))
            self._expire(n)
        slices[-1][1].add(ceil(log(value, 2) * _PER_OCTAVE) if value > 1e-6 else _KEY_FLOOR)

    def _expire(self, n: int) -> None:
        oldest = n - self._slices_max + 1
        while self._slices and self._slices[0][0] < oldest:
            self._slices.pop(0)

    def _view(self) -> None:
        """Takes the view anew, unless it is fresh."""
        now = self._clock.now()
        if now - self._view_at < self.refresh:  # an empty view is kept as long
            return
        n = int(now // self._width)
        self._expire(n)
        slices = self._slices
        filling = slices[-1][1] if slices and slices[-1][0] == n else None
        over = slices[:-1] if filling is not None else slices
        parts: list[Part] = []
        if over:
            span = (over[0][0], over[-1][0])
            if span != self._closed_span:  # a slice is over or expired since
                merged = over[0][1]
                if len(over) > 1:
                    merged = Store(BINS)
                    for _, store in over:
                        merged.merge(store)
                self._closed = _part(merged, True) if merged.count else None
                self._closed_span = span
            if self._closed is not None:
                parts.append(self._closed)
        if filling is not None and filling.count:
            parts.append(_part(filling, False))
        self._parts = tuple(parts)
        self._count = sum(cum[-1] for _, cum in parts)
        if parts:
            self._lo = min(start for start, _ in parts)
            self._hi = max(start + len(cum) - 1 for start, cum in parts)
        self._memo.clear()
        self._view_at = now

    def derived(self, key: Hashable, compute: Callable[[RollingQuantiles], float]) -> float:
        """`compute(self)`, kept under `key` until the view is refreshed (a deadline drawn
        from the quantiles is read several times a request, and changes only then)."""
        memo = self._memo
        if self._clock.now() - self._view_at >= self.refresh:  # else the view is fresh
            if self._defer is None or (value := memo.get(key)) is None:
                self._view()
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
        if self._clock.now() - self._view_at < self.refresh:  # a read refreshed it since
            return
        self._view()
        memo = self._memo
        for key, compute in self._computes.items():
            memo[key] = compute(self)

    @property
    def count(self) -> int:
        self._view()
        return int(self._count)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0..1) of the window, None when it holds no value."""
        self._view()
        if not self._count or not 0.0 <= q <= 1.0:
            return None
        memo = self._memo
        if q in memo:
            return memo[q]
        # The lowest key whose running total over the window passes the rank: ~9 halvings
        # of a span of at most 2 x BINS keys, each summing the parts' totals there.
        rank = q * (self._count - 1)
        lo, hi = self._lo, self._hi
        parts = self._parts
        while lo < hi:
            mid = (lo + hi) >> 1
            seen = 0.0
            for start, cum in parts:
                i = mid - start
                if i >= 0:
                    seen += cum[i] if i < len(cum) else cum[-1]
            if seen > rank:
                hi = mid
            else:
                lo = mid + 1
        memo[q] = value = MAPPING.value(lo)
        return value
