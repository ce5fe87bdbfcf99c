"""Which upstreams serve a model: config first, then each upstream's cached `/models` list."""

from __future__ import annotations

from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics
from tokenpipe.upstream.http import HttpUpstream


class Router:
    """The configured upstreams; `candidates(model)` those that serve it (404 when none)."""

    def __init__(self, upstreams: list[HttpUpstream]) -> None:
        self.upstreams = upstreams
        for u in upstreams:
            for m in u.settings.models:
                if m != "*":
                    metrics.allow_model(m)  # configured: a metric label value

    async def candidates(self, model: str, api: str = "openai") -> list[HttpUpstream]:
        """The upstreams speaking `api` that serve `model`, in config order."""
        found = []
        for u in self.upstreams:
            if u.settings.api != api:
                continue
            # Known without a wait almost always (config or cached list): no coroutine then.
            serves = u.serves_now(model)
            if serves is None:
                serves = await u.serves(model)
            if serves:
                found.append(u)
                if not metrics.model_known(model) and "*" in u.settings.models:
                    # Listed by the upstream (not merely forwarded): a label value too.
                    listed = await u.listed_models()
                    if listed is not None and model in listed:
                        metrics.allow_model(model)
        if not found:
            raise GatewayError(
                404,
                f"The model `{model}` does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
            )
        return found

    async def models(self) -> list[str]:
        names: set[str] = set()
        for u in self.upstreams:
            names.update(await u.models())
        return sorted(names)

    async def close(self) -> None:
        for u in self.upstreams:
            await u.close()
