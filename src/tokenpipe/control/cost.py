"""What a request costs in tokens, the way providers count it for their token buckets.

Before sending: prompt tokens (estimated) + max_tokens (or a default when absent; nothing for
an embedding, which generates no tokens). After:
the upstream's `usage.prompt_tokens` replaces the estimate and, when the request set no
max_tokens, `usage.completion_tokens` stands in for the output part.

Bounds: every figure is capped at `cap` (the model's context window where known, else
`limits.max_request_tokens`): no request reserves or is charged more than the most a model
could ever process, whatever its max_tokens or its upstream's usage says. A max_tokens above
MAX_OUTPUT_TOKENS is refused at once (400 naming the field).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tokenpipe.errors import GatewayError

#: Tokens added per chat message for role and separators (OpenAI's documented overhead is 3-4).
PER_MESSAGE = 4
#: Tokens that prime every chat reply.
PER_REPLY = 3
#: Largest max_tokens / max_completion_tokens accepted at all: ten times the largest context
#: window published (10 M tokens, Llama 4 Scout). Beyond it no model could ever run the
#: request, so it is refused at once (400) instead of being reserved.
MAX_OUTPUT_TOKENS = 100_000_000
#: Usage counts believed from an upstream (tokens); a larger or negative one is ignored.
MAX_USAGE = 1 << 53
#: A tuple, not `int | float`, which builds a union object at each call.
_NUMBERS = (int, float)
#: Most choices (`n`) a request is charged for: the chat and completions schemas' own bound.
MAX_CHOICES = 128


def _count(value: Any, bound: float) -> int | None:
    """A token count: an int (or an integral float, as JSON may spell it) in [0, bound]."""
    if type(value) is int:  # the usual case first (bool is not `int` by type)
        return value if 0 <= value <= bound else None
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 0 <= value <= bound:
        return value
    return None


#: Text up to this many characters has its separators counted whole; a longer one in three
#: samples of SAMPLE_CHARS (its start, middle and end), the densest standing for all of it.
#: str.count of one character is a plain loop (~5 machine instructions a character): the two
#: counts were a third of the CPU of a request with a 70 KB prompt (750,000 instructions,
#: benchmarks/request_instructions.py --prompt 16000), more than its JSON parse.
EXACT_CHARS = 8192
SAMPLE_CHARS = 2048


def estimate_text(text: str) -> int:
    """Prompt tokens, on the high side: a BPE token is ~4 characters of English and never
    spans two words, so the larger of the two counts rarely undershoots (no tokenizer needed:
    the estimate is corrected from `usage` anyway). Past EXACT_CHARS the word count is drawn
    from samples: a text whose separators crowd where no sample looks (a long prose, then
    short words) is estimated at its characters' count, as text without spaces always is."""
    n = len(text)
    if not n:
        return 0
    # Counting separators is C speed with no allocation (split() would copy the prompt).
    if n <= EXACT_CHARS:
        words = text.count(" ") + 1
        if "\n" in text:  # (memchr: ~1/6 of a count, and most texts have none)
            words += text.count("\n")
    else:
        mid = (n - SAMPLE_CHARS) // 2
        densest = max(
            _separators(text, 0), _separators(text, mid), _separators(text, n - SAMPLE_CHARS)
        )
        words = densest * n // SAMPLE_CHARS + 1
    chars = math.ceil(n / 4)
    return words if words > chars else chars


def _separators(text: str, start: int) -> int:
    end = start + SAMPLE_CHARS
    return text.count(" ", start, end) + text.count("\n", start, end)


def _content(content: Any) -> str:
    """A content's text: a string, or its parts' texts joined. One part of text (as the SDKs
    send a message's) is its text without a generator and a join (31 chat messages of one
    part each: 29.0 -> 17.5 us an estimate, timeit)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if len(content) == 1:
            part = content[0]
            if type(part) is dict and type(text := part.get("text")) is str:
                return text
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


@dataclass(slots=True)
class Cost:
    prompt: int  # estimated prompt tokens
    max_output: int | None  # the request's max_tokens / max_completion_tokens, if any
    default_output: int  # reserved for the output when the request sets no maximum
    #: Most tokens any figure here may be (the model's window, or the configured bound).
    cap: int | None = None
    #: The request field that sets the output part (named by a 400 when it is too large).
    output_param: str = "max_tokens"

    def _capped(self, n: int) -> int:
        cap = self.cap
        return n if cap is None or n < cap else cap

    @property
    def tokens(self) -> int:
        """The reservation made before sending."""
        out = self.max_output if self.max_output is not None else self.default_output
        return self._capped(self.prompt + out)

    def _usage(self, usage: dict[str, Any] | None) -> tuple[int, int] | None:
        if not usage:
            return None
        prompt = _count(usage.get("prompt_tokens"), MAX_USAGE)
        if prompt is None:
            return None
        return prompt, _count(usage.get("completion_tokens"), MAX_USAGE) or 0

    def charged(self, usage: dict[str, Any] | None) -> int | None:
        """What the upstream counted for its token bucket, from `usage` (None when there is
        none or it is malformed): providers count max_tokens, not the output."""
        found = self._usage(usage)
        if found is None:
            return None
        prompt, completion = found
        out = self.max_output if self.max_output is not None else completion
        return self._capped(prompt + out)

    def used(self, usage: dict[str, Any] | None) -> int | None:
        """The tokens the request really used (prompt + completion, from `usage`; None when
        there is none or it is malformed): what a key's own quota is charged in the end."""
        found = self._usage(usage)
        return None if found is None else self._capped(found[0] + found[1])


def _input(value: Any) -> int:
    """Prompt tokens of an `input` (Responses API, embeddings): a string, strings, token ids,
    lists of token ids, or Responses items (messages with content, function call outputs)."""
    if isinstance(value, str):
        return estimate_text(value)
    if not isinstance(value, list):
        return 0
    total = 0
    for x in value:
        if type(x) is dict:  # a Responses item, the usual one first (a client resends them all)
            text = x.get("content")
            if not (type(text) is str and text):
                text = _item_text(x)
            total += estimate_text(text) + PER_MESSAGE
        elif isinstance(x, str):
            total += estimate_text(x)
        elif isinstance(x, list):  # token ids
            total += len(x)
        elif isinstance(x, dict):
            total += estimate_text(_item_text(x)) + PER_MESSAGE
        else:  # one token id
            total += 1
    return total


def _item_text(item: dict[str, Any]) -> str:
    """A Responses item's text: its content's, else its output's, else its arguments."""
    text = _content(item.get("content")) or _content(item.get("output"))
    return text or str(item.get("arguments") or "")


def of_request(
    obj: dict[str, Any], default_output: int = 256, cap: int | None = None, output: bool = True
) -> Cost:
    """Cost of a chat or text completion, Responses or embeddings request body (already
    validated). `output`: the request generates tokens (an embedding does not: no output
    part). Raises a 400 GatewayError for a max_tokens no model could run (above
    MAX_OUTPUT_TOKENS)."""
    # Chat's and completions' schemas hold `n` to 1..MAX_CHOICES; the other APIs have no such
    # field and pass a client's `n` on unread (a list there was a 500): it multiplies nothing.
    n = _count(obj.get("n"), MAX_CHOICES) or 1
    if not output:
        return Cost(_input(obj.get("input")), 0, 0, cap, "input")
    param = "max_completion_tokens" if obj.get("max_completion_tokens") else "max_tokens"
    if "max_output_tokens" in obj and "messages" not in obj:  # the Responses API
        param = "max_output_tokens"
    maximum = obj.get(param)
    count = _count(maximum, MAX_OUTPUT_TOKENS)
    if (
        count is None
        and isinstance(maximum, _NUMBERS)
        and not isinstance(maximum, bool)
        and maximum > 0
    ):
        raise GatewayError(
            400,
            f"Invalid '{param}': {maximum:.6g} is more tokens than any model can produce "
            f"(at most {MAX_OUTPUT_TOKENS}).",
            code="invalid_value",
            param=param,
        )
    max_output = count * n if count is not None else None
    messages = obj.get("messages")
    if isinstance(messages, list):
        prompt = PER_REPLY + PER_MESSAGE * len(messages)
        for m in messages:  # (a loop: sum() of a generator resumes it a message)
            content = m.get("content") if type(m) is dict else None
            if type(content) is str:  # (the usual message: one call, a client resends them all)
                prompt += estimate_text(content)
            elif type(m) is dict:
                prompt += estimate_text(_content(content))
            else:
                prompt -= PER_MESSAGE  # not a message (the schema has let it through)
    else:
        p = obj.get("prompt")
        if isinstance(p, str):
            prompt = estimate_text(p)
        elif isinstance(p, list):
            prompt = sum(
                estimate_text(x) if isinstance(x, str) else len(x) if isinstance(x, list) else 1
                for x in p
            )
        elif "input" in obj:
            prompt = _input(obj["input"]) + estimate_text(str(obj.get("instructions") or ""))
        else:
            prompt = 0
    if max_output is None and "input" in obj:
        param = "input"
    elif max_output is None and not isinstance(messages, list):
        param = "prompt"
    elif max_output is None:
        param = "messages"
    return Cost(prompt, max_output, default_output * n, cap, param)
