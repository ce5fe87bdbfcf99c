"""Token cost of a request as providers count it: reserved before, corrected after."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenpipe.control import cost
from tokenpipe.control.cost import estimate_text, of_request
from tokenpipe.engines.sim import text


def test_prompt_estimate_does_not_undershoot_word_counts_or_four_chars_per_token() -> None:
    for sample in ("hi", "a b c d e f", "x" * 400, "one two\nthree four", ""):
        assert estimate_text(sample) >= text.count_tokens(sample)
        assert estimate_text(sample) >= len(sample) / 4


def test_a_long_prompt_is_estimated_from_samples_as_closely_as_counted_whole() -> None:
    """Past EXACT_CHARS the separators are counted in three samples: texts alike throughout
    (a list of numbers, indented code, prose) are estimated within 1% of the whole count,
    and never below four characters a token."""
    numbers = " ".join(str(i % 100) for i in range(40_000))
    code = "    def f(x):\n        return x + 1\n" * 3000
    prose = "The quick brown fox jumps over the lazy dog.\n" * 2000
    for sample in (numbers, code, prose):
        assert len(sample) > cost.EXACT_CHARS
        whole = max(sample.count(" ") + sample.count("\n") + 1, math.ceil(len(sample) / 4))
        assert abs(estimate_text(sample) - whole) <= whole / 100, sample[:40]
        assert estimate_text(sample) >= len(sample) / 4


def test_a_chat_is_estimated_message_by_message_whatever_each_holds() -> None:
    """A request's prompt is its messages' estimates (each as `estimate_text` gives it,
    inline for the usual string content), their overheads and the reply primer: text with
    and without line breaks, dense separators, empty, past EXACT_CHARS, content parts, none;
    an entry that is no message adds nothing."""
    contents = [
        "one two three",
        "one\ntwo\nthree\nfour",
        "a b c d e f g h",  # words outnumber four characters a token
        "\n\n\n\n\n\n",
        "",
        "x" * 40,
        "word " * 3000,  # past EXACT_CHARS: sampled
        [{"type": "text", "text": "in a part"}, {"type": "image_url", "image_url": {}}],
        None,
    ]
    messages = [{"role": "user", "content": c} for c in contents]
    want = cost.PER_REPLY + sum(
        estimate_text(cost._content(c)) + cost.PER_MESSAGE for c in contents
    )
    assert of_request({"messages": messages}).prompt == want
    assert of_request({"messages": [*messages, "not a message", 5]}).prompt == want


def test_reservation_is_prompt_plus_max_tokens_times_n() -> None:
    c = of_request({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "n": 2})
    assert c.prompt == 1 + 4 + 3  # the word, the message overhead, the reply primer
    assert c.tokens == c.prompt + 80


def test_an_n_that_is_no_choice_count_multiplies_nothing() -> None:
    """A Messages or native Responses request has no `n`: whatever a client put there is
    passed on unvalidated, and must neither raise (a list was a 500) nor grow the reservation."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    responses = {"input": "hi", "max_output_tokens": 40}
    for n in ([None], "abc", "5", {}, -3, 0, 10**30, 1e308, True, None):
        for body in (chat, responses):
            c = of_request({**body, "n": n})
            assert (c.max_output, c.default_output) == (40, 256), n
            assert c.tokens == of_request(body).tokens


def test_without_max_tokens_the_default_is_reserved_and_usage_says_the_rest() -> None:
    c = of_request({"prompt": "hello there"}, default_output=256)
    assert c.tokens == 3 + 256
    # Charged as providers count: the real prompt, and the output actually produced.
    assert c.charged({"prompt_tokens": 2, "completion_tokens": 30}) == 32
    assert c.charged(None) is None


def test_with_max_tokens_the_upstream_counts_the_maximum_not_the_output() -> None:
    c = of_request({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50})
    assert c.charged({"prompt_tokens": 9, "completion_tokens": 3}) == 59


_TEXT = st.text(max_size=40)
_PART = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("input_text")}, optional={"text": st.one_of(_TEXT, st.integers())}
    ),
    st.integers(),
)
_ITEM = st.fixed_dictionaries(
    {},
    optional={
        "content": st.one_of(_TEXT, st.none(), st.integers(), st.lists(_PART, max_size=3)),
        "output": st.one_of(_TEXT, st.lists(_PART, max_size=2)),
        "arguments": st.one_of(_TEXT, st.none()),
    },
)


def _joined(content: Any) -> str:
    """A content's text as the general reading takes it: a string, or every object part's
    text joined by spaces (the reference the shortcuts are held to)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _item_joined(item: dict[str, Any]) -> str:
    """A Responses item's text by the general reading: content, else output, else arguments."""
    text = _joined(item.get("content")) or _joined(item.get("output"))
    return text or str(item.get("arguments") or "")


@settings(max_examples=400, deadline=None)
@given(items=st.lists(_ITEM, max_size=6))
def test_a_responses_items_estimate_reads_what_its_general_reading_reads(
    items: list[dict[str, Any]],
) -> None:
    """The usual item (a string content, or one text part) is read without the general
    reading; what it reads is the same, for any content, output and arguments."""
    want = sum(estimate_text(_item_joined(x)) + cost.PER_MESSAGE for x in items)
    assert of_request({"model": "m", "input": items}, 0).prompt == want


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(
        st.fixed_dictionaries(
            {"role": st.just("user")},
            optional={"content": st.one_of(_TEXT, st.none(), st.lists(_PART, max_size=3))},
        ),
        max_size=6,
    )
)
def test_a_chat_messages_estimate_reads_what_its_general_reading_reads(
    messages: list[dict[str, Any]],
) -> None:
    """A message's content of one part is read without the join; the same text."""
    want = cost.PER_REPLY + sum(
        cost.PER_MESSAGE + estimate_text(_joined(m.get("content"))) for m in messages
    )
    assert of_request({"model": "m", "messages": messages}, 0).prompt == want
