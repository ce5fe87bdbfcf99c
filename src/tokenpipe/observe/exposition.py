"""/metrics as Prometheus text (format 0.0.4), the per-request families' lines written here.

prometheus_client's `generate_latest` formats each sample in Python, escaping and checking
every label name and value again on every scrape: ~7 us a line here. The per-request
families (fasthist.py, fastcount.py) have a series for each upstream and model, and the
scrape runs on the event loop, so every stream stopped for it: 100 upstream-model pairs made
~7,000 lines and 48 ms, 1,000 pairs 0.5 s, at each scrape (benchmarks/metrics_scrape.py).
Those families keep each child's label text, escaped once when the child is made, and write
their lines themselves: what is left per line is the value's text. The other collectors,
a few series each, still go through `generate_latest`, while the hand-written families
give it nothing (`WRITING`). A test parses the whole text with prometheus_client's parser
and finds every sample the collectors report.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import Protocol
from weakref import WeakKeyDictionary

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

#: Series a family writes before the event loop may run its streams again (`render_async`):
#: 256 histogram series are ~4,900 lines, ~3 ms here.
SLICE = 256


class Written(Protocol):
    def write(self, out: list[str]) -> Iterator[None]:
        """Appends the family's text (its HELP and TYPE lines, then a line a sample),
        pausing (a yield) after each SLICE series."""


class _Switch:
    """`on` while `render` runs `generate_latest`: the hand-written families' `collect`
    yields nothing then (their text is written already). The event loop's thread alone
    scrapes, so a flag is enough."""

    on = False


WRITING = _Switch()
#: The families whose text is written here, by registry, in the order they were made.
_FAMILIES: WeakKeyDictionary[object, list[Written]] = WeakKeyDictionary()


def add(registry: object, family: Written) -> None:
    """`family` (registered in `registry`) writes its own text when `registry` is rendered."""
    _FAMILIES.setdefault(registry, []).append(family)


def label_text(names: Sequence[str], values: Sequence[str], around: str = "") -> tuple[str, str]:
    """`name="value",...` in the order of the names, as `generate_latest` writes them, the
    values escaped as the text format wants (a backslash, a double quote, a line break):
    the labels named before `around` and those after it (a histogram's `le` goes between)."""
    pairs = sorted(zip(names, values, strict=True))
    before = ",".join(f'{n}="{_escape(v)}"' for n, v in pairs if n < around)
    after = ",".join(f'{n}="{_escape(v)}"' for n, v in pairs if n >= around)
    return before, after


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def number(x: float) -> str:
    """A sample's value as `generate_latest` writes it (Go's float format): a whole count
    below 10^6 without a call."""
    if type(x) is int and 0 <= x < 1_000_000:
        return f"{x}.0"
    return floatToGoString(x)


class _One:
    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterator[Metric]:
        yield self.family


def head(family: Metric) -> str:
    """The HELP and TYPE lines of `family` (given with no samples), as `generate_latest`
    writes them: made once a family."""
    return generate_latest(_One(family)).decode()


def render(registry: object) -> bytes:
    """The registry's text: the hand-written families', then every other collector's."""
    out: list[str] = []
    for family in _FAMILIES.get(registry, ()):
        for _ in family.write(out):
            pass
    return _with_rest([], out, registry)


async def render_async(registry: object) -> bytes:
    """`render`, letting the event loop run between slices of series (SLICE), each slice's
    lines joined and encoded before it lets go (a whole scrape's text in one join held the
    loop ~10 ms for 1,000 pairs). A scrape of 1,000 upstream-model pairs is ~40 ms of CPU,
    and a stream waits a slice for it, ~3 ms, instead. A child made meanwhile is in the next
    scrape; one counted meanwhile may show the new count in one series and not yet in
    another, as with any exporter that is not stopped while it is read."""
    done: list[bytes] = []
    out: list[str] = []
    for family in _FAMILIES.get(registry, ()):
        for _ in chain(family.write(out), (None,)):  # each slice, and the family's end
            done.append("".join(out).encode())
            out.clear()
            await asyncio.sleep(0)
    return _with_rest(done, out, registry)


def _with_rest(done: list[bytes], out: list[str], registry: object) -> bytes:
    """`done` and `out` (the hand-written text), then every other collector's."""
    WRITING.on = True
    try:
        rest = generate_latest(registry)  # type: ignore[arg-type]
    finally:
        WRITING.on = False
    return b"".join([*done, "".join(out).encode(), rest])
