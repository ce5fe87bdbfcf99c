"""Prometheus counters and gauges for the per-request series.

A prometheus_client child's `inc()` checks that it is observable, takes a lock and adds:
about 270 ns here (timeit of a labelled child's `inc()`, Python 3.11), and every request
makes six such calls (its in-flight gauge up and down, its status count, its prompt and
completion tokens, the upstream's concurrency limit as it learns), 29 Python calls in all.
These children are a float each (~45 ns an add); /metrics reads them when it is scraped,
their lines written by `write` (exposition.py says why). No lock: like fasthist.py, they
are only touched from the event loop's thread, /metrics included. Label children are
bounded where they are looked up (`metrics.child`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenpipe.observe import exposition


class FastValue:
    __slots__ = ("labels", "value")

    def __init__(self, labels: str = "") -> None:
        self.labels = labels  # its label text, `{name="value",...}` (exposition.label_text)
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class _Family(Collector):
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily]

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], FastValue] = {}
        empty = self.kind(self.name, documentation, labels=self.labelnames)
        self._head = exposition.head(empty)
        # A counter's samples are NAME_total (CounterMetricFamily's name has no suffix).
        self._sample = f"{empty.name}_total" if self.kind is CounterMetricFamily else empty.name
        registry.register(self)
        exposition.add(registry, self)

    def labels(self, *values: str) -> FastValue:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected")
        child = self._children.get(values)
        if child is None:
            _, text = exposition.label_text(self.labelnames, values)
            child = self._children[values] = FastValue(f"{{{text}}}" if text else "")
        return child

    def write(self, out: list[str]) -> Iterator[None]:
        out.append(self._head)
        sample, number = self._sample, exposition.number
        for i, child in enumerate(list(self._children.values()), 1):
            out.append(f"{sample}{child.labels} {number(child.value)}\n")
            if i % exposition.SLICE == 0:
                yield

    def describe(self) -> Iterator[Metric]:
        yield self.kind(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        if exposition.WRITING.on:
            return  # written by `write`
        family = self.kind(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        yield family


class FastCounter(_Family):
    """A counter (exposed as NAME_total). Its callers add only counts they have bounded and
    checked to be >= 0 (usage.clean); no check here."""

    kind = CounterMetricFamily


class FastGauge(_Family):
    kind = GaugeMetricFamily
