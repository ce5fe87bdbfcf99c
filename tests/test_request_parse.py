"""A large request body is parsed with the cyclic collector paused (dialects/openai_schema.py):
its containers would otherwise start a collection every threshold's worth, each walking the
tree being built (4 MiB of `[]`: 169 ms, 109 paused; benchmarks/hostile_cost.py --case body)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from tokenpipe.dialects import openai_schema
from tokenpipe.errors import GatewayError

HEAD = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"x":['
JUNK = HEAD + b",".join([b"[]"] * 200_000) + b"]}"  # 600 KB: 200,000 containers


@pytest.fixture
def collections() -> Iterator[list[int]]:
    started: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.collect()
    gc.callbacks.append(seen)
    try:
        yield started
    finally:
        gc.callbacks.remove(seen)


def test_a_large_body_starts_no_collection_while_it_is_parsed(collections: list[int]) -> None:
    assert len(JUNK) >= openai_schema.GC_PAUSE_BYTES
    req, obj = openai_schema.parse(JUNK, openai_schema.ChatRequest)
    # At most the one young collection that the count left starts once the collector is back.
    assert len(collections) <= 1 and gc.isenabled()
    assert len(obj["x"]) == 200_000 and req.model == "m"
    # The same containers made with the collector running start hundreds (else this test
    # would prove nothing).
    collections.clear()
    made: list[list[int]] = [[] for _ in range(200_000)]
    assert len(collections) > 20 and made


def test_a_refused_large_body_leaves_the_collector_on(collections: list[int]) -> None:
    bad = JUNK.replace(b'"role":"user"', b'"role":"wizard"')
    with pytest.raises(GatewayError) as e:
        openai_schema.parse(bad, openai_schema.ChatRequest)
    assert e.value.status == 400 and gc.isenabled() and len(collections) <= 1


def test_a_collector_turned_off_elsewhere_stays_off() -> None:
    gc.disable()
    try:
        openai_schema.parse(JUNK, openai_schema.ChatRequest)
        assert not gc.isenabled()
    finally:
        gc.enable()
