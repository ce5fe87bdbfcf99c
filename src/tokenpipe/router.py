"""Picks the upstream for a request and opens the upstream call.

Upstreams that serve the model are tried in config order; one that cannot be reached before
any response is passed over for the next (the simplest fallback; budgets and hedging build
on this in the tail-latency layer).
"""

from __future__ import annotations

from tokenpipe.control.traffic import Ticket
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics
from tokenpipe.upstream.h1 import UpstreamResponse
from tokenpipe.upstream.http import HttpUpstream


class Router:
    def __init__(self, upstreams: list[HttpUpstream]) -> None:
        self.upstreams = upstreams
        for u in upstreams:
            for m in u.settings.models:
                if m != "*":
                    metrics.allow_model(m)  # configured: a metric label value

    async def candidates(self, model: str) -> list[HttpUpstream]:
        found = []
        for u in self.upstreams:
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

    async def open(
        self, model: str, path: str, body: bytes, request_id: str, ticket: Ticket | None = None
    ) -> tuple[HttpUpstream, UpstreamResponse]:
        """`ticket`: the request's passage through the upstream limiters (waits for capacity
        before each send, learns from the response headers)."""
        last: GatewayError | None = None
        for upstream in await self.candidates(model):
            if ticket is not None:
                await ticket.acquire(upstream.name)  # 429 when no capacity within the deadline
            try:
                resp = await upstream.post(path, body, request_id)
            except GatewayError as e:
                if ticket is not None:
                    ticket.failed(e.status)
                last = e
                continue
            if ticket is not None:
                await ticket.arrived(resp.status, resp.headers)
            return upstream, resp
        assert last is not None
        raise last

    async def models(self) -> list[str]:
        names: set[str] = set()
        for u in self.upstreams:
            names.update(await u.models())
        return sorted(names)

    async def close(self) -> None:
        for u in self.upstreams:
            await u.close()
