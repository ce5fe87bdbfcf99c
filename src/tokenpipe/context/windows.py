"""Where a model's context window comes from, first match wins.

1. the config (`context.models[].window`);
2. the upstream's own `/v1/models` entry, which vLLM and tokenpipe local (`max_model_len`) and
   llama.cpp's server (`meta.n_ctx_train`) fill in: the window the server
   actually runs with, which can be smaller than the one the model was trained for;
3. the config's GGUF file (`{arch}.context_length`, the trained window);
4. a small table of published windows for OpenAI models.

A model with no known window is not budgeted at all: guessing would alter requests that fit.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.flight import SingleFlight
from tokenpipe.settings import MAX_MODELS
from tokenpipe.upstream.http import MODELS_RETRY, HttpUpstream
from tokenpipe.upstream.model_list import META_WINDOW_FIELDS, WINDOW_FIELDS

log = logging.getLogger("tokenpipe.context")

#: How long an upstream's answer is trusted (seconds); an unreachable one is asked again then.
DISCOVERY_TTL = 60.0
#: Bound on remembered (upstream, model) answers; the oldest is forgotten beyond it.
MAX_DISCOVERED = 4096


def window_from_entry(entry: dict[str, Any]) -> int | None:
    for key in WINDOW_FIELDS:
        value = entry.get(key)
        if isinstance(value, int) and value > 0:
            return value
    meta = entry.get("meta")
    if isinstance(meta, dict):
        for key in META_WINDOW_FIELDS:
            value = meta.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


#: (when the upstream is asked again, the windows it named by model)
_Hit = tuple[float, dict[str, int]]


class WindowDiscovery:
    """Asks each upstream's /v1/models for the windows it serves, cached for DISCOVERY_TTL."""

    def __init__(self, clock: Clock = MONOTONIC) -> None:
        self.clock = clock
        self._cache: OrderedDict[str, _Hit] = OrderedDict()
        self._fetching: SingleFlight[_Hit] = SingleFlight()

    async def window(self, upstream: HttpUpstream, model: str) -> int | None:
        hit = self._cache.get(upstream.name)
        if hit is None:
            # One fetch per upstream at a time (bounded by its 5 s); the requests that need
            # it meanwhile await that fetch.
            hit = await self._fetching.do(upstream.name, lambda: self._refresh(upstream))
        elif self.clock.now() >= hit[0]:
            # Known: the answer stays, and the fetch runs in the background (as the model
            # list's, upstream/http.py), not on the way of the request that found it old.
            self._fetching.start(upstream.name, lambda: self._refresh(upstream))
        return hit[1].get(model)

    def learn(self, upstream: HttpUpstream, data: Any) -> None:
        """The windows of a /models answer asked for elsewhere (the gateway's warm-up)."""
        self._store(upstream.name, self.clock.now() + DISCOVERY_TTL, windows_of(data))

    async def _refresh(self, upstream: HttpUpstream) -> _Hit:
        data = await upstream.models_json()
        if data is not None:
            return self._store(upstream.name, self.clock.now() + DISCOVERY_TTL, windows_of(data))
        # The upstream cannot say now: what it said last stands (none: no windows), and it
        # is asked again after MODELS_RETRY, as its model list is. (Kept for DISCOVERY_TTL,
        # one failed ask left its models unbudgeted for a minute.)
        old = self._cache.get(upstream.name)
        return self._store(
            upstream.name, self.clock.now() + MODELS_RETRY, old[1] if old is not None else {}
        )

    def _store(self, name: str, until: float, found: dict[str, int]) -> _Hit:
        hit = self._cache[name] = (until, found)
        while len(self._cache) > MAX_DISCOVERED:
            self._cache.popitem(last=False)
        return hit


def windows_of(data: Any) -> dict[str, int]:
    """The windows a /models answer names, by model: of its first MAX_MODELS entries, as the
    upstream's list of models is read (the rest are not served through it either)."""
    found: dict[str, int] = {}
    entries = data.get("data") if isinstance(data, dict) else None
    for entry in entries[:MAX_MODELS] if isinstance(entries, list) else ():
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            w = window_from_entry(entry)
            if w:
                found[entry["id"]] = w
    return found
