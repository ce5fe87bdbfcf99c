"""Prompts for the load generator: synthetic ones of a controlled length, or a JSONL file."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import orjson

# Common short English words: each is one token for BPE tokenizers (with its leading space),
# so N words make a prompt of about N tokens on any model.
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
    "my",
    "than",
    "first",
    "water",
    "been",
    "call",
    "who",
    "oil",
    "its",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
    "part",
]

#: Largest prompt file read (bytes); a larger file is an error rather than a memory spike.
MAX_PROMPT_FILE = 256 * 1024 * 1024


def synthetic(tokens: int, count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`count` distinct prompts of about `tokens` tokens (distinct so no prefix cache hides
    prefill: each starts with its own number)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        words = [rng.choice(_WORDS) for _ in range(max(0, tokens - 2))]
        out.append([{"role": "user", "content": f"{i} " + " ".join(words)}])
    return out


def from_jsonl(path: str | Path) -> list[list[dict[str, str]]]:
    """One prompt per line: `{"messages": [...]}`, `{"prompt": "..."}` or a JSON string."""
    p = Path(path)
    if p.stat().st_size > MAX_PROMPT_FILE:
        raise ValueError(f"{p}: larger than {MAX_PROMPT_FILE} bytes")
    out: list[list[dict[str, str]]] = []
    for n, line in enumerate(p.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: not JSON ({e})") from None
        if isinstance(obj, str):
            out.append([{"role": "user", "content": obj}])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            out.append(obj["messages"])
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            out.append([{"role": "user", "content": obj["prompt"]}])
        else:
            raise ValueError(
                f'{p}:{n}: expected {{"messages": [...]}}, {{"prompt": "..."}} or a string'
            )
    if not out:
        raise ValueError(f"{p}: no prompts")
    return out


def cycle(prompts: Sequence[list[dict[str, str]]], i: int) -> list[dict[str, str]]:
    return prompts[i % len(prompts)]
