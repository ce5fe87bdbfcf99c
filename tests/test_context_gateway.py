"""Context budgeting through the real gateway in front of the real sim.

The sim counts one token per whitespace-separated word, plus 4 per message and 3 per request,
and records `prompt_tokens` per request id in /sim/stats: that is how these tests see exactly
what reached the upstream. Its output continues from the last two words of the prompt, so the
answer's text proves which message came last.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from itertools import islice
from typing import Any

import httpx
import pytest
import yaml

from tests import procs
from tokenpipe.engines.sim import text as sim_text

WINDOW = 600
SUMMARY_MAX = 40
SYSTEM = {"role": "system", "content": "You are a careful assistant. [[sim ttft_ms=1]]"}
_ids = itertools.count()


def conversation(turns: int, words: int = 18, tag: str = "t") -> list[dict[str, Any]]:
    """`turns` user/assistant pairs of `words` words each, then a final user question."""
    msgs: list[dict[str, Any]] = [SYSTEM]
    for t in range(turns):
        msgs.append({"role": "user", "content": " ".join(f"{tag}{t}q{i}" for i in range(words))})
        msgs.append(
            {"role": "assistant", "content": " ".join(f"{tag}{t}a{i}" for i in range(words))}
        )
    msgs.append({"role": "user", "content": f"and now the last question {tag} zeta omega"})
    return msgs


def sim_tokens(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["content"].split()) + 4 for m in messages) + 3


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[procs.Service, procs.Service]]:
    fast = procs.sim(
        "--ttft-ms",
        "2",
        "--itl-ms",
        "0",
        "--model",
        "small-window",
        "--model",
        "summarized",
        "--model",
        "fallback",
        "--model",
        "unbudgeted",
        "--model",
        "big-summarizer",
        "--model",
        "calib",
    )
    slow = procs.sim("--ttft-ms", "5000", "--itl-ms", "0", "--model", "slow-summarizer")
    with fast, slow:
        yield fast, slow


@pytest.fixture(scope="module")
def gateway(
    sims: tuple[procs.Service, procs.Service], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[procs.Service]:
    fast, slow = sims
    config = {
        "upstreams": [
            {"name": "slow", "url": slow.url + "/v1", "models": ["slow-summarizer"]},
            {"name": "fast", "url": fast.url + "/v1"},
        ],
        "context": {
            "policy": "truncate",
            "margin_tokens": 8,
            "reserve_output_tokens": 64,
            "min_output_tokens": 16,
            "summary_max_tokens": SUMMARY_MAX,
            "summary_deadline_seconds": 5,
            # Cut only what does not fit, so each turn moves the cut and extends the summary.
            "compress_target": 1.0,
            # A summarizer with a large window, so the first summary covers every dropped turn.
            "summarizer_model": "big-summarizer",
            "models": [
                {"name": "small-window", "window": WINDOW},
                # Counted exactly (cl100k: more tokens than the sim's words, so it errs safe),
                # so the cuts depend on the messages alone, not on the estimator's learning.
                {
                    "name": "summarized",
                    "window": WINDOW,
                    "policy": "summarize",
                    "tokenizer": "tiktoken:cl100k_base",
                },
                {"name": "big-summarizer", "window": 100_000},
                {"name": "calib", "window": WINDOW},
            ],
        },
    }
    path = tmp_path_factory.mktemp("context") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with procs.gateway("--config", str(path)) as g:
        yield g


@pytest.fixture(scope="module")
def slow_gateway(
    sims: tuple[procs.Service, procs.Service], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[procs.Service]:
    fast, slow = sims
    config = {
        "upstreams": [
            {"name": "slow", "url": slow.url + "/v1", "models": ["slow-summarizer"]},
            {"name": "fast", "url": fast.url + "/v1"},
        ],
        "context": {
            "policy": "summarize",
            "summarizer_model": "slow-summarizer",
            "summary_deadline_seconds": 0.3,
            "margin_tokens": 8,
            "reserve_output_tokens": 64,
            "min_output_tokens": 16,
            "models": [{"name": "fallback", "window": WINDOW}],
        },
    }
    path = tmp_path_factory.mktemp("context-slow") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with procs.gateway("--config", str(path)) as g:
        yield g


@pytest.fixture(scope="module")
def sticky_gateway(
    sims: tuple[procs.Service, procs.Service], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[procs.Service]:
    fast, _ = sims
    config = {
        "upstreams": [{"name": "fast", "url": fast.url + "/v1"}],
        "context": {
            "compress_target": 0.6,
            "margin_tokens": 8,
            "reserve_output_tokens": 64,
            "min_output_tokens": 16,
            "summary_max_tokens": SUMMARY_MAX,
            "summarizer_model": "big-summarizer",
            "models": [
                {"name": "small-window", "window": WINDOW},
                {"name": "summarized", "window": WINDOW, "policy": "summarize"},
                {"name": "big-summarizer", "window": 100_000},
            ],
        },
    }
    path = tmp_path_factory.mktemp("context-sticky") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with procs.gateway("--config", str(path)) as g:
        yield g


def chat(
    gw: procs.Service,
    model: str,
    messages: list[dict[str, Any]],
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> tuple[httpx.Response, str]:
    rid = f"ctx-test-{next(_ids)}"
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": model, "messages": messages, **extra},
        headers={"x-request-id": rid, **(headers or {})},
        timeout=30,
    )
    return r, rid


def warm_up(gw: procs.Service, model: str) -> None:
    """One answer with usage, so the model's token estimator is calibrated and the cuts of
    the turns that follow do not move for that reason."""
    r, _ = chat(gw, model, conversation(2, tag="warm"), max_tokens=1)
    assert r.status_code == 200


def records(sim: procs.Service) -> dict[str, dict[str, Any]]:
    stats = httpx.get(sim.url + "/sim/stats", params={"last": "10000"}).json()
    return {r["id"]: r for r in stats["records"]}


def expected_answer(last_message: str, n: int) -> str:
    return "".join(islice(sim_text.words(0, last_message), n))


def test_request_that_fits_is_forwarded_unchanged(
    gateway: procs.Service, sims: tuple[procs.Service, procs.Service]
) -> None:
    msgs = conversation(3)
    r, rid = chat(gateway, "small-window", msgs, max_tokens=20)
    assert r.status_code == 200, r.text
    assert "x-tokenpipe-max-tokens" not in r.headers
    assert "x-tokenpipe-context" not in r.headers
    rec = records(sims[0])[rid]
    assert rec["prompt_tokens"] == sim_tokens(msgs)  # every message arrived
    assert r.json()["usage"]["completion_tokens"] == 20  # max_tokens as the client sent it


def test_max_tokens_is_lowered_to_what_fits_instead_of_a_400(
    gateway: procs.Service, sims: tuple[procs.Service, procs.Service]
) -> None:
    msgs = conversation(6)  # ~260 tokens: fits, but not with 500 more
    assert sim_tokens(msgs) + 500 > WINDOW
    r, _ = chat(gateway, "small-window", msgs, max_tokens=500)
    assert r.status_code == 200, r.text
    lowered = int(r.headers["x-tokenpipe-max-tokens"])
    assert 16 <= lowered < 500
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == lowered  # the upstream was asked for the lower value
    assert usage["prompt_tokens"] == sim_tokens(msgs)  # the history was not touched
    assert usage["prompt_tokens"] + lowered <= WINDOW


def test_40_turn_conversation_is_truncated_to_the_window_keeping_system_and_newest(
    gateway: procs.Service, sims: tuple[procs.Service, procs.Service]
) -> None:
    msgs = conversation(40)
    assert sim_tokens(msgs) > 2.5 * WINDOW
    r, rid = chat(gateway, "small-window", msgs, max_tokens=30)
    assert r.status_code == 200, r.text
    report = r.headers["x-tokenpipe-context"]
    assert report.startswith("policy=truncate;")
    rec = records(sims[0])[rid]
    assert 0 < rec["prompt_tokens"] + 30 <= WINDOW
    # The answer continues the last user message: it was kept, and kept last.
    answer = r.json()["choices"][0]["message"]["content"]
    assert answer == expected_answer(msgs[-1]["content"], 30)
    dropped = int(report.split("dropped_messages=")[1].split(";")[0])
    assert dropped > 0 and dropped % 2 == 0  # whole user/assistant turns
    kept_tokens = sim_tokens(msgs) - sum(
        len(m["content"].split()) + 4 for m in msgs[1 : 1 + dropped]
    )
    assert rec["prompt_tokens"] == kept_tokens  # system message + the newest turns, nothing else


def test_streamed_40_turn_conversation_is_truncated_and_reports_in_headers(
    gateway: procs.Service,
) -> None:
    msgs = conversation(40, tag="s")
    with httpx.stream(
        "POST",
        gateway.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "small-window", "messages": msgs, "stream": True},
    ) as r:
        assert r.status_code == 200
        assert r.headers["x-tokenpipe-context"].startswith("policy=truncate;")
        body = r.read().decode()
    assert body.rstrip().endswith("data: [DONE]")


def test_40_turn_conversation_is_summarized_and_next_turn_summarizes_only_new_part(
    gateway: procs.Service, sims: tuple[procs.Service, procs.Service]
) -> None:
    fast = sims[0]
    warm_up(gateway, "summarized")
    before = set(records(fast))
    msgs = conversation(40, tag="m")
    r, rid = chat(gateway, "summarized", msgs, max_tokens=30)
    assert r.status_code == 200, r.text
    report = r.headers["x-tokenpipe-context"]
    assert report.startswith("policy=summarize;") and report.endswith("summary=new")
    recs = records(fast)
    summaries = [v for k, v in recs.items() if k.startswith("ctx-summary-") and k not in before]
    assert len(summaries) == 1
    first_summary_prompt = summaries[0]["prompt_tokens"]
    assert recs[rid]["prompt_tokens"] + 30 <= WINDOW
    # The last message was kept, and kept last. (The summary may have left less than 30
    # tokens of room: then max_tokens was lowered, and says so.)
    n_out = int(r.headers.get("x-tokenpipe-max-tokens", 30))
    assert r.json()["choices"][0]["message"]["content"] == expected_answer(
        msgs[-1]["content"], n_out
    )

    # Next turn: the answer and one more question. Only the newly dropped turns (and the
    # cached summary) go to the summarizer.
    nxt = [
        *msgs,
        r.json()["choices"][0]["message"],
        {"role": "user", "content": "one more question please about it"},
    ]
    nxt[-2] = {"role": "assistant", "content": nxt[-2]["content"]}
    before = set(records(fast))
    r2, _ = chat(gateway, "summarized", nxt, max_tokens=30)
    assert r2.status_code == 200, r2.text
    assert r2.headers["x-tokenpipe-context"].endswith("summary=extended")
    recs = records(fast)
    second = [v for k, v in recs.items() if k.startswith("ctx-summary-") and k not in before]
    assert len(second) == 1
    # Instructions (~40) + the old summary (<= SUMMARY_MAX words) + about one new turn, far
    # less than the ~30 turns the first summary covered.
    assert second[0]["prompt_tokens"] < first_summary_prompt / 4
    assert second[0]["prompt_tokens"] < 40 + SUMMARY_MAX + 4 * (18 + 8) + 20

    # The same request again (a retry): the summary comes from the cache, no call at all.
    before = set(records(fast))
    r3, _ = chat(gateway, "summarized", nxt, max_tokens=30)
    assert r3.headers["x-tokenpipe-context"].endswith("summary=reused")
    assert not [k for k in records(fast) if k.startswith("ctx-summary-") and k not in before]


def test_slow_summary_falls_back_to_truncation_within_its_deadline(
    slow_gateway: procs.Service,
) -> None:
    msgs = conversation(40, tag="f")
    started = time.monotonic()
    r, _ = chat(slow_gateway, "fallback", msgs, max_tokens=30)
    elapsed = time.monotonic() - started
    assert r.status_code == 200, r.text
    report = r.headers["x-tokenpipe-context"]
    assert report.startswith("policy=truncate;") and report.endswith("summary=timeout")
    assert elapsed < 3.0  # the sim would have taken 5 s to summarise
    metrics = httpx.get(slow_gateway.url + "/metrics").text
    assert 'tokenpipe_context_summaries_total{outcome="timeout"} 1.0' in metrics
    assert 'tokenpipe_context_compressed_total{policy="truncate"} 1.0' in metrics


def test_prompt_that_cannot_fit_is_answered_400_context_length_exceeded(
    gateway: procs.Service, sims: tuple[procs.Service, procs.Service]
) -> None:
    msgs = [SYSTEM, {"role": "user", "content": "word " * (3 * WINDOW)}]
    r, rid = chat(gateway, "small-window", msgs)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert rid not in records(sims[0])  # never sent: it could only fail


def test_policy_off_per_request_forwards_an_overflowing_request_untouched(
    gateway: procs.Service, sims: tuple[procs.Service, procs.Service]
) -> None:
    msgs = conversation(40, tag="o")
    r, rid = chat(
        gateway, "small-window", msgs, max_tokens=5, headers={"x-tokenpipe-context-policy": "off"}
    )
    assert r.status_code == 200
    assert "x-tokenpipe-context" not in r.headers
    assert records(sims[0])[rid]["prompt_tokens"] == sim_tokens(msgs)


def test_model_without_a_known_window_is_never_budgeted(
    gateway: procs.Service, sims: tuple[procs.Service, procs.Service]
) -> None:
    msgs = conversation(40, tag="u")
    r, rid = chat(gateway, "unbudgeted", msgs, max_tokens=5)
    assert r.status_code == 200
    assert records(sims[0])[rid]["prompt_tokens"] == sim_tokens(msgs)


def test_compression_is_counted_in_metrics(gateway: procs.Service) -> None:
    chat(gateway, "small-window", conversation(40, tag="x"), max_tokens=10)
    text = httpx.get(gateway.url + "/metrics").text
    saved = [
        line
        for line in text.splitlines()
        if line.startswith('tokenpipe_context_tokens_saved_total{policy="truncate"}')
    ]
    assert saved and float(saved[0].split()[-1]) > 1000


def _next_turn(msgs: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    return [
        *msgs,
        {"role": "assistant", "content": f"answer {n} is short"},
        {"role": "user", "content": f"follow-up question number {n} please"},
    ]


@pytest.mark.parametrize("model", ["small-window", "summarized"])
def test_later_turns_are_cut_where_the_first_compression_cut(
    sticky_gateway: procs.Service, sims: tuple[procs.Service, procs.Service], model: str
) -> None:
    """With compress_target 0.6 the next turns fit behind the same cut: the prefix sent stays
    the same (prompt caches keep hitting) and no new summary is written."""
    warm_up(sticky_gateway, model)
    msgs = conversation(40, tag=f"k{model}")
    r, _ = chat(sticky_gateway, model, msgs, max_tokens=30)
    first = r.headers["x-tokenpipe-context"]
    dropped = first.split("dropped_messages=")[1].split(";")[0]
    before = set(records(sims[0]))
    for n in range(3):
        msgs = _next_turn(msgs, n)
        r, _ = chat(sticky_gateway, model, msgs, max_tokens=30)
        assert r.status_code == 200, r.text
        report = r.headers["x-tokenpipe-context"]
        assert f"dropped_messages={dropped};" in report
        if model == "summarized":
            assert report.endswith("summary=reused")
    new_summaries = [
        k for k in records(sims[0]) if k.startswith("ctx-summary-") and k not in before
    ]
    assert new_summaries == []


def test_estimator_learns_the_upstreams_token_ratio_from_usage(
    gateway: procs.Service, sims: tuple[procs.Service, procs.Service]
) -> None:
    """Before any answer the estimate is 4 characters per token (~1.6x the sim's count for
    this text); after one answer with usage it matches what the sim counts."""

    def estimated_vs_actual(tag: str) -> tuple[int, int]:
        r, rid = chat(gateway, "calib", conversation(40, tag=tag), max_tokens=10)
        after = int(r.headers["x-tokenpipe-context"].split("->")[1].split(";")[0])
        return after, records(sims[0])[rid]["prompt_tokens"]

    est, actual = estimated_vs_actual("c0")
    assert est > 1.3 * actual  # uncalibrated: errs towards trimming
    est, actual = estimated_vs_actual("c1")
    assert abs(est - actual) <= 0.05 * actual


def test_summary_longer_than_asked_for_falls_back_to_truncation(gateway: procs.Service) -> None:
    """An old turn carries a sim directive, so the summarising call (which reads that turn)
    answers with 300 words, far over summary_max_tokens: a failed summary (an upstream that
    ignored max_tokens; not cached), and the request is truncated instead."""
    msgs = conversation(40, tag="v")
    msgs[1] = {"role": "user", "content": msgs[1]["content"] + " [[sim output_tokens=300]]"}
    r, _ = chat(gateway, "summarized", msgs, max_tokens=30)
    assert r.status_code == 200, r.text
    report = r.headers["x-tokenpipe-context"]
    assert report.startswith("policy=truncate;") and report.endswith("summary=failed")


def test_text_completion_max_tokens_is_lowered_or_rejected(
    gateway: procs.Service, sims: tuple[procs.Service, procs.Service]
) -> None:
    # "summarized" counts with tiktoken: one cl100k token per word here, as the sim counts.
    prompt = " ".join(["river", "stone", "apple"] * 100)
    r = httpx.post(
        gateway.url + "/v1/completions",
        timeout=30,
        json={"model": "summarized", "prompt": prompt, "max_tokens": 500},
    )
    assert r.status_code == 200, r.text
    lowered = int(r.headers["x-tokenpipe-max-tokens"])
    assert lowered == WINDOW - 8 - 300  # window - margin_tokens - the exact prompt count
    assert r.json()["usage"]["completion_tokens"] == lowered
    assert r.json()["usage"]["prompt_tokens"] == 300
    r = httpx.post(
        gateway.url + "/v1/completions",
        timeout=30,
        json={"model": "summarized", "prompt": prompt * 3, "max_tokens": 5},
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_tool_definitions_count_against_the_window(gateway: procs.Service) -> None:
    """Tools are rendered into the prompt: ~400 tokens of definitions leave no room for 200
    more output tokens in a 600-token window, though the messages alone would."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "river stone apple " * 20,
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
            },
        }
        for i in range(5)
    ]
    msgs = [{"role": "user", "content": "river stone apple " * 30}]
    r, _ = chat(gateway, "summarized", msgs, max_tokens=200)
    assert "x-tokenpipe-max-tokens" not in r.headers  # without tools it fits
    r, _ = chat(gateway, "summarized", msgs, max_tokens=200, tools=tools)
    assert r.status_code == 200, r.text
    assert int(r.headers["x-tokenpipe-max-tokens"]) < 200


def limiter_passes(gw: procs.Service, upstream: str) -> float:
    """Requests that went through `upstream`'s limiter so far (its wait histogram's count)."""
    prefix = f'tokenpipe_limiter_wait_seconds_count{{upstream="{upstream}"}} '
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return 0.0


def test_a_summary_call_passes_the_upstream_limiter_like_any_request(
    gateway: procs.Service,
) -> None:
    """A summary spends the upstream's rate limits too: it waits for capacity in the limiter
    (and gives it back) instead of going around it."""
    warm_up(gateway, "summarized")
    before = limiter_passes(gateway, "fast")
    r, _ = chat(gateway, "summarized", conversation(40, tag="lim"), max_tokens=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-tokenpipe-context"].endswith("summary=new")
    assert limiter_passes(gateway, "fast") == before + 2  # the summary, then the request
