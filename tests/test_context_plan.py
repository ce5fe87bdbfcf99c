"""The pure parts of context budgeting: the plan, the counters, the summary cache, GGUF metadata."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.local_app import serving
from tokenpipe.clock import ManualClock
from tokenpipe.context import plan, summary, tokens
from tokenpipe.context.gguf_meta import read_metadata
from tokenpipe.context.windows import WindowDiscovery
from tokenpipe.control.published import known_window
from tokenpipe.settings import UpstreamSettings
from tokenpipe.upstream.http import HttpUpstream

LIMITS = plan.Limits(window=1000, margin=10, reserve_output=100, min_output=20)


def convo(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"q{t}"}, {"role": "assistant", "content": f"a{t}"}]
    msgs.append({"role": "user", "content": "last"})
    return msgs


def test_request_that_fits_is_left_alone() -> None:
    msgs = convo(3)
    d = plan.decide(msgs, [50] * len(msgs), 3, 200, LIMITS)
    assert d.action == "fits" and d.max_tokens is None


def test_max_tokens_lowered_to_the_room_left() -> None:
    msgs = convo(3)  # 8 messages x 100 + 3 = 803: room 187
    d = plan.decide(msgs, [100] * len(msgs), 3, 500, LIMITS)
    assert d.action == "lower" and d.max_tokens == 1000 - 10 - 803


def test_compression_keeps_system_and_newest_whole_turns() -> None:
    msgs = convo(10)  # 22 messages x 60 = 1320
    d = plan.decide(msgs, [60] * len(msgs), 3, 50, LIMITS)
    assert d.action == "compress"
    system, older, kept = plan.split(msgs, d.keep_from)
    assert system == [msgs[0]]
    assert kept[-1]["content"] == "last" and kept[0]["role"] == "user"
    assert older + kept == msgs[1:]  # nothing reordered, nothing lost but the older turns
    # Budget: 1000 - 10 margin - 50 output - 3 reply - 60 system = 877 -> 14 messages (7 turns
    # of 2 and the last 1 of 1: 1 + 2*7 = 15 x 60 = 900 is too many; 13 x 60 = 780 fits).
    assert len(kept) == 13 and d.prompt_tokens == 60 + 13 * 60 + 3
    assert d.max_tokens is None  # 50 output tokens fit after compression


def test_tool_results_stay_with_the_assistant_call_they_answer() -> None:
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "tool", "content": "r1", "tool_call_id": "1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]
    assert plan.turn_starts(msgs) == [1, 5]
    d = plan.decide(msgs, [300, 300, 300, 300, 300, 30], 3, 50, LIMITS)
    assert d.action == "compress" and d.keep_from == 5


def test_unfittable_last_turn_is_rejected() -> None:
    msgs = convo(2)
    costs = [10] * (len(msgs) - 1) + [990]
    assert plan.decide(msgs, costs, 3, 50, LIMITS).action == "reject"
    assert plan.decide_text(995, None, LIMITS).action == "reject"
    assert plan.decide_text(900, 500, LIMITS) == plan.Decision(
        "lower", max_tokens=90, prompt_tokens=900
    )


def test_tiktoken_counts_exactly_with_the_packaged_cl100k_encoding() -> None:
    counter = tokens.open_counter("auto", "gpt-4-turbo", None)
    assert counter is not None and counter.exact and counter.name == "tiktoken:cl100k_base"
    # OpenAI cookbook, "How to count tokens with tiktoken": "tiktoken is great!" is 6 tokens.
    assert counter.count("tiktoken is great!") == 6
    # The cookbook's chat example for gpt-4-0613 counts 129 prompt tokens for its 6 messages.
    example = [
        {
            "role": "system",
            "content": "You are a helpful, pattern-following assistant that "
            "translates corporate jargon into plain English.",
        },
        {
            "role": "system",
            "name": "example_user",
            "content": "New synergies will help drive top-line growth.",
        },
        {
            "role": "system",
            "name": "example_assistant",
            "content": "Things working well together will increase revenue.",
        },
        {
            "role": "system",
            "name": "example_user",
            "content": "Let's circle back when we have "
            "more bandwidth to touch base on opportunities for increased leverage.",
        },
        {
            "role": "system",
            "name": "example_assistant",
            "content": "Let's talk later when we're less busy about how to do better.",
        },
        {
            "role": "user",
            "content": "This late pivot means we don't have time to boil the "
            "ocean for the client deliverable.",
        },
    ]
    assert sum(tokens.count_messages(counter, example)) + counter.chat.reply == 129


def test_unknown_model_gets_the_estimator_which_learns_from_usage() -> None:
    assert tokens.open_counter("auto", "some-local-model", None) is None
    est = tokens.Estimator()
    text = " ".join(f"word{i}" for i in range(200))  # 200 sim tokens, ~1290 chars
    assert est.count(text) > 300  # 4 chars per token: too high for this text
    est.observe(len(text), overhead=7, prompt_tokens=200 + 7)
    assert abs(est.count(text) - 200) <= 1
    est.observe(len(text), overhead=0, prompt_tokens=0)  # a broken report teaches nothing
    assert abs(est.count(text) - 200) <= 1


def test_summary_cache_finds_the_longest_summarised_prefix_and_stays_bounded() -> None:
    msgs = [{"role": "user", "content": str(i)} for i in range(10)]
    hashes = summary.prefix_hashes(msgs)
    cache = summary.SummaryCache(entries=2)
    cache.put(hashes[4], "s4")
    cache.put(hashes[6], "s6")
    assert cache.longest(hashes, 9) == (6, "s6")
    assert cache.longest(hashes, 5) == (4, "s4")
    other = summary.prefix_hashes([{"role": "user", "content": "x"}, *msgs[1:]])
    assert cache.longest(other, 9) == (0, None)  # a different history shares nothing
    cache.put(hashes[8], "s8")
    # s4 was read after s6 was written: s6 is the least recently used and goes.
    assert len(cache) == 2 and cache.get(hashes[6]) is None and cache.get(hashes[4]) == "s4"


async def test_concurrent_turns_share_one_summary_call() -> None:
    cache = summary.SummaryCache(entries=8)
    calls = 0
    release = asyncio.Event()

    async def write() -> str:
        nonlocal calls
        calls += 1
        await release.wait()
        return "s"

    tasks = [asyncio.create_task(cache.once(b"k", write)) for _ in range(3)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(*tasks) == ["s", "s", "s"]
    assert calls == 1 and cache.get(b"k") == "s"


def _gguf(path: Path, kvs: list[tuple[str, int, bytes]]) -> None:
    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x)) + x.encode()

    body = b"".join(s(k) + struct.pack("<I", t) + v for k, t, v in kvs)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + body)


def test_gguf_reader_keeps_scalars_and_skips_large_arrays(tmp_path: Path) -> None:
    vocab = struct.pack("<IQ", 8, 5000) + b"".join(
        struct.pack("<Q", 3) + b"tok" for _ in range(5000)
    )
    path = tmp_path / "m.gguf"
    _gguf(
        path,
        [
            ("general.architecture", 8, struct.pack("<Q", 5) + b"llama"),
            ("tokenizer.ggml.tokens", 9, vocab),
            ("llama.block_count", 4, struct.pack("<I", 32)),
            (
                "llama.attention.head_count_kv",
                9,
                struct.pack("<IQ", 4, 2) + struct.pack("<II", 8, 4),
            ),
            ("llama.rope.freq_base", 6, struct.pack("<f", 0.5)),
        ],
    )
    meta = read_metadata(path)
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.tokens"] is None
    assert meta["llama.block_count"] == 32
    assert meta["llama.attention.head_count_kv"] == [8, 4]
    assert meta["llama.rope.freq_base"] == 0.5


def test_known_windows_match_by_longest_prefix() -> None:
    assert known_window("gpt-4o-mini") == 128_000
    assert known_window("gpt-4-0613") == 8_192
    assert known_window("gpt-4-turbo-2024-04-09") == 128_000
    assert known_window("my-model") is None


async def test_window_is_discovered_from_the_upstream_models_list_and_cached() -> None:
    hits = 0

    async def models(request: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": "served", "object": "model", "max_model_len": 4096},
                    {"id": "llamacpp", "object": "model", "meta": {"n_ctx_train": 8192}},
                    {"id": "plain", "object": "model"},
                ],
            }
        )

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serving(app) as url:
        upstream = HttpUpstream(UpstreamSettings(name="u", url=f"{url}/v1"))
        clock = ManualClock()
        found = WindowDiscovery(clock)
        try:
            assert await found.window(upstream, "served") == 4096
            assert await found.window(upstream, "llamacpp") == 8192
            assert await found.window(upstream, "plain") is None
            assert hits == 1
            clock.advance(61)
            assert await found.window(upstream, "served") == 4096  # the last answer, at once
            while hits < 2:  # asked again, in the background
                await asyncio.sleep(0)
        finally:
            await upstream.close()


@pytest.mark.parametrize("spec", ["estimate", "tiktoken:no_such_encoding"])
def test_counter_specs_without_a_tokenizer_fall_back_to_estimating(spec: str) -> None:
    assert tokens.open_counter(spec, "gpt-4", None) is None


class _Words:
    """A counter of whitespace-separated words that records what it was asked to count."""

    exact = True
    name = "words"
    chat = tokens.DEFAULT_CHAT

    def __init__(self) -> None:
        self.asked: list[str] = []

    def count(self, text: str) -> int:
        self.asked.append(text)
        return len(text.split())


def test_resent_history_is_tokenized_once() -> None:
    inner = _Words()
    counter = tokens.CachedCounter(inner, entries=8)
    turn1 = convo(1)
    assert tokens.count_messages(counter, turn1) == tokens.count_messages(_Words(), turn1)
    asked = len(inner.asked)
    turn2 = [*turn1, {"role": "assistant", "content": "new answer"}]
    tokens.count_messages(counter, turn2)
    assert inner.asked[asked:] == ["new answer"]  # only the new message was tokenized
    for i in range(10):  # bounded: the oldest entries go
        counter.count(f"text {i}")
    assert len(counter._seen) == 8


def test_byte_bound_is_never_below_the_exact_count() -> None:
    counter = tokens.open_counter("tiktoken:cl100k_base", "gpt-4", None)
    assert counter is not None
    msgs = [
        {"role": "user", "content": "naïve café — 東京 🚀 x" * 20, "name": "bob"},
        {"role": "assistant", "content": "ok " * 50},
    ]
    exact = sum(tokens.count_messages(counter, msgs)) + counter.chat.reply
    assert exact <= tokens.upper_bound(counter, msgs)


_TEXT = st.text(max_size=300)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
    optional={
        "content": st.one_of(
            _TEXT,
            st.none(),
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=3),
        ),
        "name": st.one_of(_TEXT, st.none()),
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {"function": st.fixed_dictionaries({"name": _TEXT, "arguments": _TEXT})}
            ),
            max_size=2,
        ),
    },
)


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(_MESSAGE, max_size=12),
    k=st.floats(tokens.Estimator.K_MIN, tokens.Estimator.K_MAX),
)
def test_the_estimates_bound_is_never_below_its_count(
    messages: list[dict[str, Any]], k: float
) -> None:
    """The bound the context budget's fast path trusts (a request far below the window is
    let through without counting each message) is never below the count it stands for; and
    a plain message's text, taken without a call, is what `message_text` gives."""
    est = tokens.Estimator()
    est.k = k
    texts = tokens.message_texts(messages)
    assert texts == [tokens.message_text(m) for m in messages]
    counted = sum(tokens.count_messages(est, messages, texts)) + est.chat.reply
    assert counted <= est.upper_bound(messages, texts)
