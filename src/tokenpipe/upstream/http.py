"""An OpenAI-compatible HTTP upstream: one pool of keep-alive connections per upstream
(upstream/h1.py).

Only the configuration chooses where a request goes and which headers it carries: no client
header, URL or key is forwarded (except the request id, which the gateway itself vetted, and,
when traced, the W3C trace context of the gateway's own span for the send).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from typing import Any

from yarl import URL

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control.pacing import PACE_HEADER
from tokenpipe.errors import GatewayError
from tokenpipe.flight import SingleFlight
from tokenpipe.log_budget import LogBudget
from tokenpipe.settings import MAX_MODELS, UpstreamSettings
from tokenpipe.upstream import h1, model_list
from tokenpipe.upstream.errors import UpstreamError, UpstreamProtocolError
from tokenpipe.upstream.responses_probe import ResponsesProbe, verdict

log = logging.getLogger("tokenpipe.upstream")
#: The line of a list past MAX_MODELS: the list is asked for each MODELS_TTL, and says the same
#: each time. Bound: the upstreams' names (config).
_OVER_MAX_MODELS = LogBudget(log, every=3600.0)

#: Largest non-streamed upstream body read into memory (bytes); larger ones are a 502.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
#: How long a list of the upstream's models is trusted before it is asked again (seconds).
MODELS_TTL = 60.0
#: How long after a failed /models the upstream is not asked again (seconds): one that has no
#: such route must not get an extra request in front of every completion.
MODELS_RETRY = 10.0
#: Largest /models answer read (bytes); a larger one counts as no answer.
MAX_MODELS_BYTES = 4 * 1024 * 1024
#: Seconds one /models request may take (past it: logged, None).
MODELS_TIMEOUT = 5.0
#: Largest answer to the /responses probe read (bytes): an error body; a larger one is left.
MAX_PROBE_BYTES = 64 * 1024
#: The error code of an upstream whose bytes are broken (HTTP/1.1, SSE or JSON): not retried.
PROTOCOL_ERROR = "upstream_protocol_error"
#: Characters of a model id kept from an upstream's /models: a client's bound on a model
#: name (dialects/openai_schema.py, MAX_MODEL_NAME).
MAX_MODEL_ID = 256
# Model ids kept from one upstream's /models, MAX_MODELS (settings.py, where a config's list
# of an upstream's models has the same bound): its first ones, in its order; the entries past
# them are ignored (one log line an hour per upstream, `_OVER_MAX_MODELS`). The largest real
# lists are far below (OpenRouter ~500, Together ~200, a vLLM or llama.cpp a few); a 4 MiB
# answer (MAX_MODELS_BYTES) holds 100,000 short ids: 31 MiB kept, and the gateway's own
# GET /v1/models rendered all of them.
#: The fixed headers of a completion request (the body is always JSON, possibly a stream).
_ACCEPT_POST = "content-type: application/json\r\naccept: text/event-stream\r\n"


def _auth_headers(settings: UpstreamSettings, key: str | None) -> str:
    """The upstream's own auth (and version) header lines, per the API it speaks."""
    if settings.api == "anthropic":
        version = settings.anthropic_version
        if "\r" in version or "\n" in version:
            raise ValueError(f"upstream '{settings.name}': anthropic_version has a line break")
        return (f"x-api-key: {key}\r\n" if key else "") + f"anthropic-version: {version}\r\n"
    return f"authorization: Bearer {key}\r\n" if key else ""


class HttpUpstream:
    def __init__(self, settings: UpstreamSettings, clock: Clock = MONOTONIC) -> None:
        self.settings = settings
        self.name = settings.name
        self.clock = clock  # the model list's age
        self._url = URL(settings.url.rstrip("/"))
        self._pool: h1.Pool | None = None
        self._base_path = self._url.raw_path.rstrip("/")
        # The request head but its per-request lines, built once (a header value from the
        # config with a line break would forge headers: refused here).
        key = settings.api_key()
        if key and ("\r" in key or "\n" in key):
            raise ValueError(f"upstream '{self.name}': its API key contains a line break")
        self._auth = _auth_headers(settings, key)
        self._heads: dict[str, bytes] = {}
        # The listed ids (at most MAX_MODELS), one frozenset per change of the list: membership
        # on each request is a hash (a list's scan of 100,000 ids cost 5 ms a request), and
        # the object itself says "unchanged" to the caches built from it (router/candidates.py).
        #: The config's names for membership (its list holds up to MAX_MODELS), and "*".
        self._names = frozenset(settings.models)
        self._any = "*" in self._names
        self._models: frozenset[str] | None = None
        self._models_at = 0.0
        self._models_failed_at = -MODELS_RETRY
        # One /models request at a time, shared by its callers (flight.py); and over it one
        # parse of the list into the model cache, so a burst's callers parse (and log) once.
        self._json_flight: SingleFlight[Any] = SingleFlight()
        self._models_flight: SingleFlight[frozenset[str] | None] = SingleFlight()
        self._responses = ResponsesProbe(self._ask_responses)

    @property
    def pool(self) -> h1.Pool:
        if self._pool is None:
            self._pool = h1.Pool(
                self._url,
                limit=self.settings.max_connections,
                connect_timeout=self.settings.connect_timeout_seconds,
                receive_buffer_bytes=self.settings.receive_buffer_bytes,
                keepalive_s=self.settings.keepalive_seconds,
                warm=self.settings.warm_connections,
                warm_s=self.settings.warm_seconds,
            )
        return self._pool

    @property
    def private(self) -> bool:
        """Its last connection went to this machine or a private network (h1.Pool)."""
        return self._pool is not None and self._pool.private

    def _head(self, method: str, path: str, accept: str) -> bytes:
        """The request line and the config's headers for `path` (cached per path)."""
        key = f"{method} {path}"
        head = self._heads.get(key)
        if head is None:
            head = self._heads[key] = (
                f"{method} {self._base_path}{path} HTTP/1.1\r\n"
                f"host: {self.pool.host_header}\r\n"
                f"{accept}{self._auth}"
            ).encode("latin-1")
        return head

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    async def post(
        self,
        path: str,
        body: bytes,
        request_id: str,
        stream: bool = False,
        *,
        pace: float | None = None,
        trace: bytes = b"",
    ) -> h1.UpstreamResponse:
        """Sends a request and returns once the response headers arrived.

        Raises GatewayError 502 when the upstream cannot be reached, 504 when it does not answer
        in time. The caller owns the response and must close or release it.

        `stream`: the caller bounds the waits itself, for the headers and the first token
        (router.attempt.send) and for each read of the body (relay.stall.StallWatch: the
        stall deadline, capped by `read_timeout_seconds`, with one timer per stream); a read
        timeout of the client's own would re-arm a timer on every chunk, i.e. every token.

        `pace`: the rate (tokens/s) the client renders at, sent as PACE_HEADER; None or 0:
        none. `trace`: header lines of the send's trace context (`traceparent`, `tracestate`:
        observe/tracing.py builds them), b"" when untraced.
        """
        head = b"%sx-request-id: %s\r\n%s%scontent-length: %d\r\n\r\n" % (
            self._head("POST", path, _ACCEPT_POST),
            request_id.encode("latin-1"),
            f"{PACE_HEADER}: {pace:g}\r\n".encode() if pace else b"",
            trace,
            len(body),
        )
        timeout = None if stream else self.settings.read_timeout_seconds
        try:
            return await self.pool.request(head, body, timeout)
        except TimeoutError:
            raise GatewayError(
                504, f"Upstream '{self.name}' did not answer in time.", code="upstream_timeout"
            ) from None
        except UpstreamProtocolError as e:
            raise GatewayError(
                502, f"Upstream '{self.name}' broke the protocol: {e}.", code=PROTOCOL_ERROR
            ) from None
        except UpstreamError as e:  # unreachable, or disconnected before the head
            raise GatewayError(
                502,
                f"Upstream '{self.name}' is unreachable ({type(e).__name__}).",
                code="upstream_unavailable",
            ) from None

    async def models_json(self) -> Any:
        """The upstream's own /models answer, parsed; None when it cannot say (logged).
        Callers at the same time share one request: a cold burst's model check
        (`listed_models`) and its context-window discovery each ask for the list."""
        return await self._json_flight.do(None, self._ask_models)

    async def warm(self) -> Any:
        """Asks for /models before any request needs it (the gateway's start): the first
        connection is opened, the host looked up and the model list learned. Returns the
        answer parsed (the window discovery learns from it too), or None, which marks
        nothing: the first request asks as it would have. Logs nothing: an upstream that
        is still starting does not answer yet."""
        data = await self._json_flight.do(None, functools.partial(self._ask_models, quiet=True))
        if data is not None:
            self._learn(data, self.clock.now())
        return data

    async def _ask_models(self, quiet: bool = False) -> Any:
        # Anthropic's list is paged (20 models by default): its largest page holds all.
        path = "/models?limit=1000" if self.settings.api == "anthropic" else "/models"
        head = self._head("GET", path, "") + b"\r\n"
        try:
            async with asyncio.timeout(MODELS_TIMEOUT):
                resp = await self.pool.request(head, b"", MODELS_TIMEOUT)
                try:
                    if resp.status != 200:
                        return None
                    return model_list.read(await read_bounded(resp, MAX_MODELS_BYTES))
                finally:
                    resp.close()
        except (TimeoutError, UpstreamError, GatewayError, ValueError):  # (ValueError: not JSON)
            if not quiet:
                log.warning("upstream %s: could not list its models", self.name)
            return None

    def serves_responses_now(self) -> bool | None:
        """`serves_responses()` when it is known without asking the upstream, else None."""
        mode = self.settings.responses
        if mode != "auto":
            return mode == "native"
        return self._responses.now()

    async def serves_responses(self, limit: float = math.inf) -> bool:
        """Does a /v1/responses request pass through to its /responses (`responses:
        native`, or `auto` and the probe found the route)? Waits at most `limit` seconds
        (and at most responses_probe.TIMEOUT) when the upstream must be asked."""
        known = self.serves_responses_now()
        if known is not None:
            return known
        return await self._responses.served(limit)

    async def _ask_responses(self, timeout: float) -> int | None:
        """POST /responses `{}` (responses_probe.py): the status of the answer, None when none
        came within `timeout` seconds."""
        head = self._head("POST", "/responses", _ACCEPT_POST) + b"content-length: 2\r\n\r\n"
        try:
            async with asyncio.timeout(timeout):
                resp = await self.pool.request(head, b"{}", timeout)
                try:
                    # Read, so the connection goes back to the pool; the body says nothing more.
                    with contextlib.suppress(GatewayError, UpstreamError):
                        await read_bounded(resp, MAX_PROBE_BYTES)
                finally:
                    resp.close()
        except (TimeoutError, UpstreamError) as e:
            log.warning(
                "upstream %s: no answer to POST /responses (%s): /v1/responses translated to "
                "chat for now",
                self.name,
                type(e).__name__,
            )
            return None
        way = {True: "passed through", False: "translated to chat", None: "chat for now"}
        log.info(
            "upstream %s: POST /responses answered %d: /v1/responses %s",
            self.name,
            resp.status,
            way[verdict(resp.status)],
        )
        return resp.status

    async def serves(self, model: str) -> bool:
        known = self.serves_now(model)
        if known is not None:
            return known
        listed = await self.listed_models()
        return listed is None or model in listed

    def serves_now(self, model: str) -> bool | None:
        """`serves(model)` when it is known without asking the upstream, else None."""
        if model in self._names:
            return True
        if not self._any:
            return False
        hit, listed = self._cached_models(self.clock.now())
        if not hit:
            return None
        return listed is None or model in listed

    async def listed_models(self) -> frozenset[str] | None:
        """The upstream's own /v1/models (its first MAX_MODELS ids), cached for MODELS_TTL;
        None when it cannot say (not asked again for MODELS_RETRY). The same object until
        the list changes."""
        hit, found = self._cached_models(self.clock.now())
        if hit:
            return found
        return await self._models_flight.do(None, self._fetch_models)

    def _cached_models(self, now: float) -> tuple[bool, frozenset[str] | None]:
        """(True, answer) while the last list is fresh or the last failure recent. Once a
        list is known it stays the answer: past MODELS_TTL it is asked for again in the
        background (one request at a time, and after a failure not before MODELS_RETRY),
        so no request waits for /models after the first. Awaited there, the round trip to
        a remote upstream's /models was on the way of every request that came while it was
        asked, once a minute."""
        models = self._models
        if models is not None:
            if now - self._models_at >= MODELS_TTL and now - self._models_failed_at >= MODELS_RETRY:
                self._models_flight.start(None, self._fetch_models)
            return True, models
        return now - self._models_failed_at < MODELS_RETRY, None

    async def _fetch_models(self) -> frozenset[str] | None:
        now = self.clock.now()
        data = await self.models_json()
        models = self._learn(data, now)
        if models is None:
            if data is not None:
                log.warning("upstream %s: its /models answer has no model list", self.name)
            self._models_failed_at = now
        return models

    def _learn(self, data: Any, now: float) -> frozenset[str] | None:
        """The model ids of a /models answer (its first MAX_MODELS), kept as of `now`; None
        if it holds none. The last set stays when the ids are the same."""
        try:
            listed = data["data"]
        except (KeyError, TypeError):  # not an object, or no "data"
            return None
        if not isinstance(listed, list):
            return None
        # An id that is not a string (`[1, "b"]`, `[["a"]]`) is skipped: one such id made the
        # whole list a 500 (sorted, in a set), every other upstream's models with it. So is
        # one longer than a client may name (its metric label, its span name).
        ids: set[str] = set()
        for at, m in enumerate(listed):
            if len(ids) == MAX_MODELS:
                _OVER_MAX_MODELS.warning(
                    self.name,
                    "upstream %s: its /models lists more than %d models: the %d entries "
                    "after them are ignored",
                    self.name,
                    MAX_MODELS,
                    len(listed) - at,
                )
                break
            name = m.get("id") if isinstance(m, dict) else None
            if isinstance(name, str) and len(name) <= MAX_MODEL_ID:
                ids.add(name)
        if not ids and listed:
            return None
        old = self._models
        models = old if old is not None and old == ids else frozenset(ids)
        self._models, self._models_at = models, now
        return models


async def read_bounded(resp: h1.UpstreamResponse, limit: int = MAX_RESPONSE_BYTES) -> bytes:
    if resp.content_length is not None and resp.content_length > limit:
        raise GatewayError(502, "Upstream response too large.", code="upstream_response_too_large")
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.iter_any():
        size += len(chunk)
        if size > limit:
            raise GatewayError(
                502, "Upstream response too large.", code="upstream_response_too_large"
            )
        parts.append(chunk)
    return b"".join(parts)
