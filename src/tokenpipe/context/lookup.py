"""What the context hop looks up per model: its window and its token counter.

Both are found once and remembered: the window in the order `windows` describes (config, the
upstream's `/v1/models`, the config's GGUF, the table of published windows), the counter by
loading the model's tokenizer. Kept apart from `windows`, which control/traffic.py imports,
so that module stays free of the router.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Mapping

from tokenpipe.context import tokens
from tokenpipe.context.gguf_meta import GGUFError, read_metadata
from tokenpipe.context.windows import WindowDiscovery
from tokenpipe.control.published import known_window
from tokenpipe.flight import SingleFlight
from tokenpipe.router import Router
from tokenpipe.settings import ContextModel

log = logging.getLogger("tokenpipe.context")

#: Models whose counters and estimators are remembered; the oldest is forgotten beyond it
#: (an exact counter stays loaded: only the model's entry goes).
MAX_MODELS = 1024
#: Models' counters told at info level; later ones at debug.
ANNOUNCED = 64


class ModelLookup:
    def __init__(self, models: Mapping[str, ContextModel], router: Router) -> None:
        self.models = models
        self.router = router
        self.discovery = WindowDiscovery()
        #: A model's counter, by name (MAX_MODELS, least recently used forgotten first).
        self._counters: OrderedDict[str, tokens.TokenCounter] = OrderedDict()
        self._named = 0  # models given a counter so far
        #: Loaded tokenizers (None: not available here). Unbounded in code, bounded in fact:
        #: their names come from the config and tokens.tokenizer_of's fixed table, never
        #: from a client's text.
        self._tokenizers: dict[str, tokens.TokenCounter | None] = {}
        self._gguf_windows: dict[str, int | None] = {}
        self._loading: SingleFlight[tokens.TokenCounter | None] = SingleFlight()

    async def window(self, model: str) -> int | None:
        cfg = self.models.get(model)
        if cfg is not None and cfg.window:
            return cfg.window
        upstreams = await self.router.candidates(model, required=False)
        for upstream in upstreams[:1]:  # the one tried first
            found = await self.discovery.window(upstream, model)
            if found:
                return found
        if cfg is not None and cfg.gguf:
            return self._gguf_window(cfg.gguf)
        return known_window(model)

    def _gguf_window(self, path: str) -> int | None:
        if path not in self._gguf_windows:
            try:
                meta = read_metadata(tokens.resolve_gguf(path))
                arch = meta.get("general.architecture")
                value = meta.get(f"{arch}.context_length")
                self._gguf_windows[path] = value if isinstance(value, int) else None
            except (OSError, GGUFError, ImportError) as e:
                log.warning("context: cannot read GGUF %s: %s", path, e)
                self._gguf_windows[path] = None
        return self._gguf_windows[path]

    async def warm(self) -> None:
        """Loads the counters of the configured models before any request needs one (a GGUF
        vocabulary takes about a second: without this the first request waits for it)."""
        for model in self.models:
            try:
                await self.counter(model)
            except ValueError as e:  # a bad tokenizer spec: its first request says so
                log.warning("context: %s: %s", model, e)

    async def counter(self, model: str) -> tokens.TokenCounter:
        """The model's counter; the first use of a tokenizer loads it off the event loop (a
        GGUF vocabulary takes about a second), once however many requests need it meanwhile.

        Counters are kept by tokenizer, not by model name: every name that maps to one (a
        client may make up `gpt-4-...` names at will) shares its counter and its cache of
        counts. Kept by name, each made-up name held a cache of its own (up to ~11 MiB at
        65,536 texts, 1,024 names), and a flood of names evicted a GGUF counter that then
        took a second to load again. Estimators stay one a model: each learns its own ratio.
        """
        found = self._counters.get(model)
        if found is not None:
            self._counters.move_to_end(model)
            return found
        cfg = self.models.get(model)
        name = tokens.tokenizer_of(
            cfg.tokenizer if cfg else "auto", model, cfg.gguf if cfg else None
        )
        counter: tokens.TokenCounter | None = None
        if name is not None:
            if name in self._tokenizers:
                counter = self._tokenizers[name]
            else:
                counter = await self._loading.do(name, lambda: self._load(name))
            found = self._counters.get(model)  # another request's, while this one waited
            if found is not None:
                return found
        return self._remember(model, counter or tokens.Estimator())

    async def _load(self, name: str) -> tokens.TokenCounter | None:
        counter = await asyncio.to_thread(tokens.load_tokenizer, name)
        self._tokenizers[name] = counter
        return counter

    def _remember(self, model: str, counter: tokens.TokenCounter) -> tokens.TokenCounter:
        # A client names any model: the first ANNOUNCED are told, the rest at debug (a
        # stream of made-up names wrote a line each).
        self._named += 1
        say = log.info if self._named <= ANNOUNCED else log.debug
        say("context: %s counts tokens with %s", model, counter.name)
        self._counters[model] = counter
        while len(self._counters) > MAX_MODELS:
            self._counters.popitem(last=False)
        return counter
