"""A Prometheus histogram for per-token observations.

prometheus_client's Histogram takes a lock and walks its buckets in Python on every observe
(about 2 us here); the inter-token histogram is observed once per streamed chunk, so that cost
would be most of the relay's per-token budget. This one counts into a list at a C `bisect`
index (about 0.3 us) and builds cumulative buckets only when /metrics is scraped, its lines
written by `write` (exposition.py says why). No lock: it is only touched from the event loop
thread.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenpipe.observe import exposition


class FastHistogramChild:
    __slots__ = ("bounds", "counts", "labels", "sum")

    def __init__(self, bounds: tuple[float, ...], labels: tuple[str, str] = ("", "")) -> None:
        self.bounds = bounds
        #: Its label text (exposition.label_text): the labels before `le`, those after.
        self.labels = labels
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are `le` (<=): bisect_left puts a value equal to an edge in it.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class FastHistogram(Collector):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        self._edges = [*(repr(b) if b != int(b) else f"{b:.1f}" for b in self.bounds), "+Inf"]
        self._children: dict[tuple[str, ...], FastHistogramChild] = {}
        empty = HistogramMetricFamily(name, documentation, labels=self.labelnames)
        self._head = exposition.head(empty)
        registry.register(self)
        exposition.add(registry, self)

    def labels(self, *values: str) -> FastHistogramChild:
        child = self._children.get(values)
        if child is None:
            text = exposition.label_text(self.labelnames, values, around="le")
            child = self._children[values] = FastHistogramChild(self.bounds, text)
        return child

    def write(self, out: list[str]) -> Iterator[None]:
        out.append(self._head)
        name, edges, number = self.name, self._edges, exposition.number
        for i, child in enumerate(list(self._children.values()), 1):
            before, after = child.labels
            bucket = f"{name}_bucket{{{before}," if before else f"{name}_bucket{{"
            close = f",{after}}}" if after else "}"
            running = 0
            for edge, n in zip(edges, child.counts, strict=True):
                running += n
                out.append(f'{bucket}le="{edge}"{close} {number(running)}\n')
            both = f"{before},{after}" if before and after else before or after
            tail = f"{{{both}}}" if both else ""
            out.append(f"{name}_count{tail} {number(running)}\n")
            out.append(f"{name}_sum{tail} {number(child.sum)}\n")
            if i % exposition.SLICE == 0:
                yield

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        if exposition.WRITING.on:
            return  # written by `write`
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        edges = self._edges
        for values, child in list(self._children.items()):
            running = 0
            cumulative = []
            for edge, n in zip(edges, child.counts, strict=True):
                running += n
                cumulative.append((edge, running))
            family.add_metric(list(values), cumulative, child.sum)
        yield family
