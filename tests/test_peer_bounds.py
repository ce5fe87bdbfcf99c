"""Sizes a peer sets, bounded where they are kept, logged or traced (an audit of
2026-12-06, eighth session, docs/reliability.md): a client's model name, an upstream's
finish reason, the log lines about an upstream's bad usage counts."""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest
from opentelemetry import trace

from tests.traced import peak_bytes
from tokenpipe import answer_fields, usage
from tokenpipe.clock import ManualClock
from tokenpipe.context import tokens
from tokenpipe.context.lookup import ANNOUNCED, MAX_MODELS, ModelLookup
from tokenpipe.context.windows import windows_of
from tokenpipe.dialects import openai_schema
from tokenpipe.dialects.anthropic_schema import CountTokensRequest, MessagesRequest
from tokenpipe.dialects.chat_request import chat_request
from tokenpipe.dialects.embeddings import EmbeddingsRequest
from tokenpipe.dialects.openai_schema import MAX_MODEL_NAME, ChatRequest, CompletionRequest
from tokenpipe.dialects.responses_request import ResponsesRequest, to_chat
from tokenpipe.errors import MAX_MESSAGE, GatewayError
from tokenpipe.log_budget import LogBudget
from tokenpipe.observe import metrics
from tokenpipe.observe.tracing import RequestTrace
from tokenpipe.router.candidates import Router
from tokenpipe.upstream.http import MAX_MODELS as MAX_LISTED

_MESSAGES = [{"role": "user", "content": "hi"}]
BODIES: list[tuple[type[Any], dict[str, Any]]] = [
    (ChatRequest, {"messages": _MESSAGES}),
    (CompletionRequest, {"prompt": "hi"}),
    (MessagesRequest, {"messages": _MESSAGES, "max_tokens": 8}),
    (CountTokensRequest, {"messages": _MESSAGES}),
    (EmbeddingsRequest, {"input": "hi"}),
    (ResponsesRequest, {"input": "hi"}),
]


@pytest.mark.parametrize(("kind", "body"), BODIES)
def test_a_model_name_past_its_bound_is_a_400_naming_model(kind: type, body: dict) -> None:
    """Unbounded, one name could be most of a 4 MiB body, kept by the window lookup's cache
    and the latency estimators (200 such names held 430 MB), logged and traced."""
    ok = orjson.dumps({**body, "model": "m" * MAX_MODEL_NAME})
    assert openai_schema.parse(ok, kind)[0].model == "m" * MAX_MODEL_NAME
    with pytest.raises(GatewayError) as e:
        openai_schema.parse(orjson.dumps({**body, "model": "m" * (MAX_MODEL_NAME + 1)}), kind)
    assert e.value.status == 400 and e.value.param == "model"


def test_bad_usage_counts_are_logged_once_a_minute_an_upstream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An upstream that always sends a bad count wrote a line per request."""
    clock = ManualClock(1000.0)
    kept, usage._budget = usage._budget, LogBudget(usage.log, clock=clock)
    try:
        with caplog.at_level(logging.WARNING, logger="tokenpipe.usage"):
            for t in (1000.0, 1001.0, 1030.0):
                clock.t = t
                usage._warn("u", "prompt_tokens", "x")
            usage._warn("v", "prompt_tokens", "x")  # another upstream: its own line
            clock.t = 1060.5
            usage._warn("u", "prompt_tokens", "x")
    finally:
        usage._budget = kept
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("upstream u sent usage.prompt_tokens") and "more" not in lines[0]
    assert lines[1].startswith("upstream v") and lines[2].endswith("(2 more since the last line)")
    assert usage.clean({"prompt_tokens": "x", "completion_tokens": 3}, "w") == {
        "completion_tokens": 3
    }


@pytest.mark.parametrize("bad", [True, -1, usage.MAX_COUNT + 1, 1.0, "3", None, [1]])
@pytest.mark.parametrize("field", usage.COUNTS)
def test_a_bad_count_among_good_ones_is_dropped_and_the_rest_kept(field: str, bad: object) -> None:
    """Every count there and good (the usual object) is kept as it came; one bad count among
    them goes, whichever field it is, and the others stay."""
    good = {"prompt_tokens": 0, "completion_tokens": usage.MAX_COUNT, "total_tokens": 7, "x": 1}
    assert usage.clean(dict(good), "u") == good
    got = usage.clean({**good, field: bad}, "u")
    assert got == {k: v for k, v in good.items() if k != field}


def test_an_upstreams_finish_reason_is_traced_bounded() -> None:
    """A 1 MB finish reason was 1 MB in the span (10 MB a batch of spans)."""
    span = trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)
    t = RequestTrace(span)
    t.saw(None, "x" * 1_000_000)
    for answer in ({"choices": [{"finish_reason": "y" * 1_000_000}]}, {"stop_reason": "z" * 10**6}):
        body = orjson.dumps(answer)
        t.answer(200, answer_fields.read(body), body)
    assert [len(r) for r in t.finish_reasons] == [64, 64, 64]


def test_a_traced_answer_is_read_for_its_facts_not_parsed_whole() -> None:
    """With tracing on, each non-streamed answer was parsed whole for its model and finish
    reasons: 57 MiB of `[]`s in a field no one reads cost 5 s of the event loop and 1.8 GiB.
    Now only the fields read are decoded."""
    span = trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)
    t = RequestTrace(span)
    junk = b"[" + b",".join([b"[]"] * 2_000_000) + b"]"  # 6 MiB, ~170 MiB parsed
    body = b'{"model":"m-1","x":' + junk + b',"choices":[{"finish_reason":"stop"}]}'
    _, peak = peak_bytes(lambda: t.answer(200, answer_fields.read(body), body))
    assert peak < len(body), peak
    assert t.response_model == "m-1" and t.finish_reasons == ["stop"]
    body = b'{"choices": 5, "stop_reason": ["no"], "status": "completed"}'
    t.answer(200, answer_fields.read(body), body)
    assert t.finish_reasons == ["stop", "completed"]


async def test_a_stream_of_made_up_model_names_is_not_a_line_each_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every new name a client sent loaded a counter and wrote an info line."""
    lookup = ModelLookup({}, Router([]))
    with caplog.at_level(logging.INFO, logger="tokenpipe.context"):
        for i in range(ANNOUNCED + 20):
            await lookup.counter(f"gpt-4o-made-up-{i}")
    told = [r for r in caplog.records if "counts tokens with" in r.getMessage()]
    assert len(told) == ANNOUNCED


async def test_made_up_names_of_one_tokenizer_share_its_counter_and_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each made-up `gpt-4-...` name loaded a tiktoken counter of its own, with its own cache
    of counts (~11 MiB full, 1,024 names kept): a client's names multiplied the memory."""
    loads: list[str] = []
    real = tokens.load_tokenizer

    def load(name: str) -> tokens.TokenCounter | None:
        loads.append(name)
        return real(name)

    monkeypatch.setattr(tokens, "load_tokenizer", load)
    lookup = ModelLookup({}, Router([]))
    first = await lookup.counter("gpt-4-made-up-0")
    assert first.exact and first.name == "tiktoken:cl100k_base"
    first.count("counted once")
    for i in range(1, MAX_MODELS + 10):  # past the names kept: the first is forgotten
        assert await lookup.counter(f"gpt-4-made-up-{i}") is first
    assert await lookup.counter("gpt-4-made-up-0") is first  # not loaded again
    assert loads == ["tiktoken:cl100k_base"]
    assert isinstance(first, tokens.CachedCounter) and len(first._seen) == 1


async def test_estimators_stay_one_a_model() -> None:
    """An estimator learns its model's ratio: two models never share one."""
    lookup = ModelLookup({}, Router([]))
    a, b = await lookup.counter("made-up-a"), await lookup.counter("made-up-b")
    assert not a.exact and a is not b and await lookup.counter("made-up-a") is a


def test_an_upstreams_odd_statuses_fold_into_their_class_as_label_values() -> None:
    """Each status 100-599 an upstream answered (and the gateway passed on) was a label value
    of its own, times models, APIs and upstreams: 201 statuses made 5,025 series."""
    series = metrics.request_series("chat", "peer-bounds", "m")
    for status in range(400, 600):
        series.requests(status).inc()
    seen = {
        s.labels["status"]
        for m in metrics.REGISTRY.collect()
        if m.name == "tokenpipe_requests"
        for s in m.samples
        if s.labels.get("upstream") == "peer-bounds"
    }
    assert seen == {x for x in metrics.STATUSES if x[0] in "45"} | {"4xx", "5xx"}
    assert metrics.status_label("200") == "200" and metrics.status_label("x") == metrics.OTHER


def test_the_windows_of_a_long_model_list_are_read_as_far_as_its_models() -> None:
    """A window was kept for every entry of a /models answer (100,000 in its 4 MiB)."""
    entries = [{"id": f"m{i}", "max_model_len": 8192} for i in range(MAX_LISTED + 5)]
    found = windows_of({"data": entries})
    assert len(found) == MAX_LISTED and f"m{MAX_LISTED - 1}" in found


def test_an_unknown_responses_parameter_is_named_bounded() -> None:
    """A 1 MB key was echoed whole, in the message and as `param`."""
    with pytest.raises(GatewayError) as e:
        to_chat({"model": "m", "input": "hi", "k" * 1_000_000: 1})
    assert e.value.param == "k" * 64 and len(e.value.message) < 100


def test_an_error_quoting_what_a_client_sent_is_bounded() -> None:
    """A 400 that quotes the client's value (here its `tool_choice`) quoted all of it."""
    body = {"model": "m", "max_tokens": 8, "messages": _MESSAGES}
    with pytest.raises(GatewayError) as e:
        chat_request({**body, "tool_choice": {"type": "x" * 1_000_000}})
    assert e.value.param == "tool_choice"
    assert len(e.value.message) == MAX_MESSAGE + 3 and e.value.message.endswith("...")
