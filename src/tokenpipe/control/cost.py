"""What a request costs in tokens, the way providers count it for their token buckets.

Before sending: prompt tokens (estimated) + max_tokens (or a default when absent). After:
the upstream's `usage.prompt_tokens` replaces the estimate and, when the request set no
max_tokens, `usage.completion_tokens` stands in for the output part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: Tokens added per chat message for role and separators (OpenAI's documented overhead is 3-4).
PER_MESSAGE = 4
#: Tokens that prime every chat reply.
PER_REPLY = 3


def estimate_text(text: str) -> int:
    """Prompt tokens, on the high side: a BPE token is ~4 characters of English and never
    spans two words, so the larger of the two counts rarely undershoots (no tokenizer needed:
    the estimate is corrected from `usage` anyway)."""
    if not text:
        return 0
    # Counting separators is C speed with no allocation (split() would copy the prompt).
    words = text.count(" ") + text.count("\n") + 1
    return max(words, math.ceil(len(text) / 4))


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


@dataclass(slots=True)
class Cost:
    prompt: int  # estimated prompt tokens
    max_output: int | None  # the request's max_tokens / max_completion_tokens, if any
    default_output: int  # reserved for the output when the request sets no maximum

    @property
    def tokens(self) -> int:
        """The reservation made before sending."""
        out = self.max_output if self.max_output is not None else self.default_output
        return self.prompt + out

    def charged(self, usage: dict[str, Any] | None) -> int | None:
        """What the upstream counted, from `usage` (None when there is none)."""
        if not usage:
            return None
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens") or 0
        if not isinstance(prompt, int):
            return None
        out = self.max_output if self.max_output is not None else int(completion)
        return prompt + out


def of_request(obj: dict[str, Any], default_output: int = 256) -> Cost:
    """Cost of a chat or text completion request body (already validated)."""
    n = obj.get("n") or 1
    maximum = obj.get("max_completion_tokens") or obj.get("max_tokens")
    max_output = int(maximum) * int(n) if isinstance(maximum, int) else None
    messages = obj.get("messages")
    if isinstance(messages, list):
        prompt = (
            sum(
                estimate_text(_content(m.get("content"))) + PER_MESSAGE
                for m in messages
                if isinstance(m, dict)
            )
            + PER_REPLY
        )
    else:
        p = obj.get("prompt")
        if isinstance(p, str):
            prompt = estimate_text(p)
        elif isinstance(p, list):
            prompt = sum(
                estimate_text(x) if isinstance(x, str) else len(x) if isinstance(x, list) else 1
                for x in p
            )
        else:
            prompt = 0
    return Cost(prompt, max_output, default_output * int(n))
