"""/metrics written by hand for the per-request families (observe/exposition.py): the same
samples, names, label texts and values as prometheus_client's own `generate_latest`, every
sample the collectors report read back by Prometheus' parser, and a scrape that lets the
event loop run between slices of series."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenpipe.observe import exposition, metrics
from tokenpipe.observe.fastcount import FastCounter, FastGauge
from tokenpipe.observe.fasthist import FastHistogram

ODD = 'we"ird\\mo\ndel'  # a quote, a backslash, a line break


def _samples(text: str) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    return {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_families_write_what_generate_latest_writes() -> None:
    registry = CollectorRegistry()
    hist = FastHistogram("t_hist", "a \\ histogram\nof", ("zeta", "api"), (0.5, 2), registry)
    count = FastCounter("t_count", "a counter", ("status", "model"), registry)
    gauge = FastGauge("t_gauge", "a gauge", ("model",), registry)
    bare = FastGauge("t_bare", "no labels", (), registry)
    hist.labels("z", ODD).observe(0.5)  # on an edge: in its bucket (le)
    hist.labels("z", "chat").observe(7.25)
    count.labels("200", ODD).inc(3)
    count.labels("429", "m").inc(2_500_000)  # past 10^6: Go's exponent form
    gauge.labels("m").set(0.1)
    gauge.labels("n").set(float("inf"))
    bare.labels().set(-2)
    count.labels("500", "unused")  # made, never counted: 0.0
    text = exposition.render(registry).decode()
    exposition.WRITING.on = True  # what generate_latest alone writes of the others: nothing
    try:
        assert generate_latest(registry) == b""
    finally:
        exposition.WRITING.on = False
    assert sorted(text.splitlines()) == sorted(generate_latest(registry).decode().splitlines())
    assert 't_count_total{model="we\\"ird\\\\mo\\ndel",status="200"} 3.0' in text
    assert 't_count_total{model="m",status="429"} 2.5e+06' in text
    assert 't_hist_bucket{api="chat",le="+Inf",zeta="z"} 1.0' in text  # `le` in its place
    assert "t_bare -2.0" in text


def test_metrics_reads_back_every_sample_the_collectors_report() -> None:
    metrics.allow_model("exposed-model")
    labels = ("chat", "exposed", "exposed-model")
    metrics.child(metrics.TTFT, *labels).observe(0.2)
    metrics.child(metrics.REQUESTS, "200", *labels).inc()
    metrics.child(metrics.INFLIGHT, *labels).inc()
    metrics.RETRIES.labels("ttft_deadline", "exhausted").inc()  # prometheus_client's own
    text = metrics.render().decode()
    assert not exposition.WRITING.on  # collect works again after a scrape
    reported = _samples(generate_latest(metrics.REGISTRY).decode())
    assert _samples(text) == reported
    ttft = (("api", "chat"), ("model", "exposed-model"), ("upstream", "exposed"))
    assert ("tokenpipe_ttft_seconds_count", ttft, 1.0) in reported


async def test_a_scrape_lets_the_streams_run_between_slices_of_series() -> None:
    """render_async writes what render writes, and other tasks run while it does: with
    three slices of series, a task that counts its turns gets at least three before the
    scrape ends."""
    registry = CollectorRegistry()
    hist = FastHistogram("t_slices", "sliced", ("model",), (1.0,), registry)
    for i in range(3 * exposition.SLICE):
        hist.labels(f"m{i}").observe(0.5)
    turns = 0
    done = False

    async def other() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    await asyncio.sleep(0)  # it starts
    turns = 0
    text = await exposition.render_async(registry)
    done = True
    await task
    assert turns >= 3
    assert text == exposition.render(registry)
    assert text.count(b"t_slices_count{") == 3 * exposition.SLICE
