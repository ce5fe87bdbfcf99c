"""Deterministic text for the sim.

Each next word depends only on the seed and the two words before it, whether those came from
the prompt or from the output. So a continuation request (prompt + the text so far) produces
exactly the rest of the uninterrupted answer, which lets tests prove seamless mid-stream
recovery. One "token" is one word with its leading space.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

_ONSETS = ("b", "c", "d", "f", "g", "l", "m", "n", "p", "r", "s", "t", "v", "pr", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "n", "s", "r", "l")


def _vocabulary(size: int = 997) -> tuple[str, ...]:
    syllables = [o + v for o in _ONSETS for v in _VOWELS]  # 80
    words: list[str] = []
    for i in range(size):
        a = syllables[i % len(syllables)]
        b = syllables[(i * 7 + 3) % len(syllables)]
        coda = _CODAS[(i // len(syllables)) % len(_CODAS)]
        words.append(a + b + coda if i % 3 else a + coda or a)
    # Keep the list free of duplicates so word -> index is a bijection.
    seen: dict[str, None] = {}
    for i, w in enumerate(words):
        while w in seen:
            w = w + _VOWELS[i % 5]
        seen[w] = None
    return tuple(seen)


VOCAB = _vocabulary()
_N = len(VOCAB)
_INDEX = {w: i for i, w in enumerate(VOCAB)}


def _index(word: str) -> int:
    i = _INDEX.get(word)
    return i if i is not None else zlib.crc32(word.encode()) % _N


def _next(seed: int, a: int, b: int) -> int:
    h = (a * 1_000_003) ^ (b * 7_919) ^ (seed * 2_654_435_761)
    h = (h * 0x9E3779B1) & 0xFFFFFFFF
    return (h ^ (h >> 15)) % _N


def words(seed: int, context: str) -> Iterator[str]:
    """Endless tokens (" word") that follow `context`."""
    tail = context.split()[-2:]
    a = _index(tail[0]) if len(tail) == 2 else 0
    b = _index(tail[-1]) if tail else 0
    while True:
        c = _next(seed, a, b)
        yield " " + VOCAB[c]
        a, b = b, c


def count_tokens(text: str) -> int:
    return len(text.split())


def content_text(content: Any) -> str:
    """The text of a chat message's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prompt_text(prompt: Any) -> str:
    """The text of a completion's prompt: a string, or a list of them (TypeError else)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(p if isinstance(p, str) else str(p) for p in prompt)
    raise TypeError("prompt")
