"""Hypothesis strategies for request bodies shaped like each API's real ones, with any field
swapped for any JSON value (tests/test_fuzz_http.py): valid enough to pass the first checks,
so the translations and the upstream path below them see hostile values too."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

#: The models the fuzz gateway serves: SERVED on an OpenAI upstream, CLAUDE on an Anthropic
#: one (both the sim). A request for one of the API it was not sent in is translated.
SERVED = "sim-model"
CLAUDE = "claude-sim"

#: Tokens a fuzz case may ask the sim for (1 ms each): a huge `max_tokens` is a long answer,
#: not a fault, and would only hold the case past its answer deadline.
MAX_OUTPUT = 64
_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def short(body: Any) -> Any:
    """`body` with its output limits (if integers) at most MAX_OUTPUT."""
    if isinstance(body, dict):
        for key in _LIMITS:
            value = body.get(key)
            if type(value) is int and value > MAX_OUTPUT:
                body[key] = MAX_OUTPUT
    return body


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
models = json_values | st.sampled_from([SERVED, CLAUDE])


def _objects(*keys: str) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with some of `keys`, each any JSON value or a plausible one."""
    plausible = json_values | st.sampled_from(["text", "function", "message", "user", "x"])
    return st.dictionaries(st.sampled_from(keys), plausible, max_size=len(keys))


def _near(valid: dict[str, Any], swaps: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=swaps).map(lambda c: short({**valid, **c}))


_STREAM_OPTIONS = json_values | st.fixed_dictionaries(
    {}, optional={"include_usage": json_values, "max_tokens_per_second": json_values}
)
_CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
chat = _near(
    _CHAT,
    {
        "model": models,
        "messages": json_values | st.lists(_objects("role", "content", "name")),
        "prompt": json_values,
        "stream": json_values,
        "stream_options": _STREAM_OPTIONS,
        "max_tokens": json_values,
        "n": json_values,
        "temperature": json_values,
        "top_p": json_values,
        "tools": json_values | st.lists(_objects("type", "function")),
        "tool_choice": json_values,
    },
)
_PARTS = st.lists(_objects("type", "text", "image_url", "detail"), max_size=3)
responses = _near(
    {"model": SERVED, "input": "hi", "max_output_tokens": 3},
    {
        "model": models,
        "input": json_values
        | st.lists(
            _objects("type", "role", "content", "call_id", "name", "arguments", "output")
            | st.fixed_dictionaries({"role": st.just("user"), "content": _PARTS}),
            max_size=3,
        ),
        "instructions": json_values,
        "stream": json_values,
        "stream_options": _STREAM_OPTIONS,
        "max_output_tokens": json_values,
        "temperature": json_values,
        "tools": json_values | st.lists(_objects("type", "name", "parameters", "strict")),
        "tool_choice": json_values,
        "text": json_values | st.fixed_dictionaries({}, optional={"format": json_values}),
        "reasoning": json_values,
        "metadata": json_values,
        "truncation": json_values,
        "store": json_values,
        "previous_response_id": json_values,
        "n": json_values,
    },
)
embeddings = _near(
    {"model": SERVED, "input": "hi"},
    {
        "model": models,
        "input": json_values,
        "encoding_format": json_values,
        "dimensions": json_values,
        "stream": json_values,
        "user": json_values,
    },
)
_BLOCKS = st.lists(
    _objects("type", "text", "id", "name", "input", "tool_use_id", "content", "source"),
    max_size=3,
)
_MESSAGES = {
    "model": models,
    "messages": json_values
    | st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant"]), "content": st.text() | _BLOCKS}
        ),
        max_size=3,
    ),
    "system": json_values | _BLOCKS,
    "tools": json_values | st.lists(_objects("name", "input_schema", "type", "description")),
    "tool_choice": json_values | _objects("type", "name"),
    "thinking": json_values,
    "n": json_values,  # not a field of the API: passed on, never read as chat's (it was a 500)
}
messages = _near(
    {"model": CLAUDE, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
    {
        **_MESSAGES,
        "max_tokens": json_values,
        "stream": json_values,
        "temperature": json_values,
        "stop_sequences": json_values,
        "metadata": json_values,
    },
)
count_tokens = _near({"model": CLAUDE, "messages": [{"role": "user", "content": "hi"}]}, _MESSAGES)

#: Route -> its near-valid bodies.
NEAR_VALID = {
    "/v1/chat/completions": chat,
    "/v1/completions": chat.map(lambda b: {**b, "prompt": b.get("prompt", "hi")}),
    "/v1/responses": responses,
    "/v1/embeddings": embeddings,
    "/v1/messages": messages,
    "/v1/messages/count_tokens": count_tokens,
}
