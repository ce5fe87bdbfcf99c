"""The sim's embeddings: a deterministic unit vector per input, seeded from the sim's seed
and the input itself (the same text always gets the same vector; different texts almost
never do), as floats or base64 float32 (what the openai SDK asks for by default)."""

from __future__ import annotations

import base64
import hashlib
import math
import random
import struct
from typing import Any

import orjson

#: Length of a vector when the request gives no `dimensions`.
DIMENSIONS = 16
#: Longest vector the sim writes.
MAX_DIMENSIONS = 4096
#: Most inputs one request may hold (OpenAI's own bound). Past it: TypeError (a 400).
#: A single input of token ids is one input, whatever its length.
MAX_INPUTS = 2048
#: Most numbers one answer may hold (inputs x dimensions). Each is drawn in Python, ~0.5 us,
#: with the event loop held: this bound keeps one request under ~0.5 s of it. Unbounded, a
#: 16 MiB body of 5 million empty inputs asked for 20 billion. Past it: a 400.
MAX_VALUES = 1_048_576


def inputs(value: Any) -> tuple[list[Any], str, int]:
    """The request's inputs (one each), their text (where directives are read) and their
    tokens as the sim counts them (words; one per token id). Raises TypeError when broken
    or more than MAX_INPUTS."""
    if isinstance(value, str):
        return [value], value, len(value.split())
    if not isinstance(value, list) or not value:
        raise TypeError("input")
    if all(isinstance(x, int) for x in value):  # one input of token ids
        return [value], "", len(value)
    if len(value) > MAX_INPUTS:
        raise TypeError("input")
    texts, tokens = [], 0
    for x in value:
        if isinstance(x, str):
            texts.append(x)
            tokens += len(x.split())
        elif isinstance(x, list) and all(isinstance(t, int) for t in x):
            tokens += len(x)
        else:
            raise TypeError("input")
    return list(value), " ".join(texts), tokens


def vector(seed: int, item: Any, dims: int) -> list[float]:
    digest = hashlib.blake2b(orjson.dumps([seed, item]), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    v = [rng.gauss(0.0, 1.0) for _ in range(dims)]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def body(seed: int, model: str, items: list[Any], dims: int, fmt: str, prompt_tokens: int) -> bytes:
    data = []
    for i, item in enumerate(items):
        v = vector(seed, item, dims)
        value: Any = v
        if fmt == "base64":
            value = base64.b64encode(struct.pack(f"<{dims}f", *v)).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return orjson.dumps({"object": "list", "data": data, "model": model, "usage": usage})
