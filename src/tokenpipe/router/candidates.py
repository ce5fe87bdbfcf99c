"""Which upstreams serve a model: config first, then each upstream's cached `/models` list."""

from __future__ import annotations

from dataclasses import dataclass

from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics
from tokenpipe.upstream.http import HttpUpstream


@dataclass(slots=True, eq=False)
class Listing:
    """The models the upstreams serve (configured names and their lists), built once per
    change of a list: `names` sorted (GET /v1/models and its pages), `known` for membership.
    `body`: the OpenAI-shaped list the front made of it, kept with it so that a client
    polling GET /v1/models costs a lookup until a list changes (100,000 listed ids took
    166 ms of the event loop's CPU a call)."""

    names: tuple[str, ...]
    known: frozenset[str]
    body: bytes | None = None


class Router:
    """The configured upstreams; `candidates(model)` those that serve it (404 when none).

    A request asks which upstreams serve its model two to four times (its API, usage, the
    context window, the order of its attempts). The configured names are indexed by API and
    model, so a question costs a lookup and a look at the upstreams that take any model
    (`"*"`), not a pass over every upstream and its list of names: with 100 upstreams of
    three models each that pass took 14 us, 140 with 1,000 (the bound), 1.5 ms with 100 of
    1,000 models each (benchmarks/router_candidates.py)."""

    def __init__(self, upstreams: list[HttpUpstream]) -> None:
        self.upstreams = upstreams
        self._configured = frozenset(m for u in upstreams for m in u.settings.models if m != "*")
        for m in self._configured:
            metrics.allow_model(m)  # configured: a metric label value
        #: (api, model) -> the upstreams naming the model, in config order.
        self._named: dict[tuple[str, str], list[HttpUpstream]] = {}
        #: api -> the upstreams taking any model ("*"), in config order.
        self._any: dict[str, list[HttpUpstream]] = {}
        #: An upstream's place in the config (the order of a model's candidates).
        self._place: dict[HttpUpstream, int] = {}
        for i, u in enumerate(upstreams):
            self._place[u] = i
            api = u.settings.api
            for m in dict.fromkeys(u.settings.models):  # (a name listed twice: once)
                if m != "*":
                    self._named.setdefault((api, m), []).append(u)
            if "*" in u.settings.models:
                self._any.setdefault(api, []).append(u)
        self._listing: Listing | None = None
        # The upstreams' lists `_listing` was built of (upstream/http.py keeps one object per
        # change of a list): the same objects, the same listing.
        self._listed: list[frozenset[str] | None] = []

    async def candidates(
        self, model: str, api: str = "openai", *, required: bool = True
    ) -> list[HttpUpstream]:
        """The upstreams speaking `api` that serve `model`, in config order. None: 404 if
        `required`, else an empty list (for a caller that only asks which API serves a model,
        or its window: an error raised and caught costs ~1.3 us)."""
        named = self._named.get((api, model))
        found = list(named) if named is not None else []
        for u in self._any.get(api, ()):
            if named is not None and u in named:
                continue  # named it: served, and a label value already
            # Known without a wait almost always (a cached list): no coroutine then.
            serves = u.serves_now(model)
            if serves is None:
                serves = await u.serves(model)
            if serves:
                found.append(u)
                if not metrics.model_known(model):
                    # Listed by the upstream (not merely forwarded): a label value too.
                    listed = await u.listed_models()
                    if listed is not None and model in listed:
                        metrics.allow_model(model)
        if not found and required:
            raise GatewayError(
                404,
                f"The model `{model}` does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
            )
        if named is not None and len(found) > len(named):  # both kinds: in config order
            found.sort(key=self._place.__getitem__)
        return found

    async def models(self) -> Listing:
        """Every upstream's models (a "*" upstream's own list, asked when not known)."""
        listed = [
            await u.listed_models() if "*" in u.settings.models else None for u in self.upstreams
        ]
        listing = self._listing
        if listing is None or any(a is not b for a, b in zip(listed, self._listed, strict=True)):
            names = self._configured.union(*(x for x in listed if x is not None))
            listing = self._listing = Listing(tuple(sorted(names)), names)
            self._listed = listed
        return listing

    async def close(self) -> None:
        for u in self.upstreams:
            await u.close()
