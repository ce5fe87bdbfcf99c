"""An OpenAI-compatible HTTP upstream: one pooled aiohttp session per upstream.

Only the configuration chooses where a request goes and which headers it carries: no client
header, URL or key is forwarded (except the request id, which the gateway itself vetted).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from contextvars import ContextVar

import aiohttp
import orjson
from aiohappyeyeballs import AddrInfoType
from yarl import URL

from tokenpipe.errors import GatewayError
from tokenpipe.front.pacing import PACE_HEADER
from tokenpipe.settings import UpstreamSettings

log = logging.getLogger("tokenpipe.upstream")

#: Largest non-streamed upstream body read into memory (bytes); larger ones are a 502.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
#: The pace (tokens/s) the client of the current request renders at, set by the front for the
#: request's task (a number the gateway vetted, never a client header passed on). Upstreams
#: that generate (`tokenpipe local`) slow decoding to it instead of racing into buffers;
#: others ignore the header.
PACE: ContextVar[float | None] = ContextVar("tokenpipe_pace", default=None)
#: How long a list of the upstream's models is trusted before it is asked again (seconds).
MODELS_TTL = 60.0
#: How long after a failed /models the upstream is not asked again (seconds): one that has no
#: such route must not get an extra request in front of every completion.
MODELS_RETRY = 10.0


class HttpUpstream:
    def __init__(self, settings: UpstreamSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.base_url = settings.url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, connect=settings.connect_timeout_seconds, sock_read=None
        )
        self._headers = {"content-type": "application/json", "accept": "text/event-stream"}
        key = settings.api_key()
        if key:
            self._headers["authorization"] = f"Bearer {key}"
        self._models: list[str] | None = None
        self._models_at = 0.0
        self._models_failed_at = -MODELS_RETRY
        self._models_lock = asyncio.Lock()  # one /models request at a time (a cold burst)
        # Parsed once per path: aiohttp parses a str URL on every request.
        self._urls: dict[str, URL] = {}

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self.settings.max_connections,
                ttl_dns_cache=300,
                keepalive_timeout=30,
                socket_factory=self._socket if self.settings.receive_buffer_bytes else None,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=self.settings.connect_timeout_seconds,
                    sock_read=self.settings.read_timeout_seconds,
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                # No cookies: one upstream session serves every client, so a cookie an
                # upstream sets (e.g. a CDN's) must not travel with other clients' requests.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    def _socket(self, addr_info: AddrInfoType) -> socket.socket:
        # Set before connect: the TCP window scale is fixed by the handshake.
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.settings.receive_buffer_bytes)
        return sock

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(
        self, path: str, body: bytes, request_id: str, stream: bool = False
    ) -> aiohttp.ClientResponse:
        """Sends a request and returns once the response headers arrived.

        Raises GatewayError 502 when the upstream cannot be reached, 504 when it does not answer
        in time. The caller owns the response and must close or release it.

        `stream`: the caller bounds the waits itself, for the headers and the first token
        (tail.TailControl._attempt) and for each read of the body (tail.StreamGuard: the
        stall deadline, capped by `read_timeout_seconds`, with one timer per stream);
        aiohttp's own read timeout would re-arm a timer on every chunk, i.e. every token.
        """
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base_url + path)
        headers = dict(self._headers)
        headers["x-request-id"] = request_id
        pace = PACE.get()
        if pace:
            headers[PACE_HEADER] = f"{pace:g}"
        try:
            if not stream:
                return await self.session.post(
                    url, data=body, headers=headers, allow_redirects=False
                )
            return await self.session.post(
                url,
                data=body,
                headers=headers,
                allow_redirects=False,
                timeout=self._stream_timeout,
            )
        except TimeoutError:
            raise GatewayError(
                504, f"Upstream '{self.name}' did not answer in time.", code="upstream_timeout"
            ) from None
        except aiohttp.ClientError as e:
            raise GatewayError(
                502,
                f"Upstream '{self.name}' is unreachable ({type(e).__name__}).",
                code="upstream_unavailable",
            ) from None

    async def serves(self, model: str) -> bool:
        models = self.settings.models
        if model in models:
            return True
        if "*" not in models:
            return False
        known = await self.listed_models()
        return known is None or model in known

    async def models(self) -> list[str]:
        """The models this upstream serves: configured names and its own /v1/models list."""
        configured = [m for m in self.settings.models if m != "*"]
        listed = await self.listed_models() if "*" in self.settings.models else None
        return sorted(set(configured) | set(listed or ()))

    async def listed_models(self) -> list[str] | None:
        """The upstream's own /v1/models, cached for MODELS_TTL; None when it cannot say (not
        asked again for MODELS_RETRY)."""
        hit, found = self._cached_models(time.monotonic())
        if hit:
            return found
        async with self._models_lock:
            now = time.monotonic()
            hit, found = self._cached_models(now)
            if hit:  # fetched (or failed) while this request waited for the lock
                return found
            return await self._fetch_models(now)

    def _cached_models(self, now: float) -> tuple[bool, list[str] | None]:
        """(True, answer) while the last list is fresh or the last failure recent."""
        if self._models is not None and now - self._models_at < MODELS_TTL:
            return True, self._models
        return now - self._models_failed_at < MODELS_RETRY, None

    async def _fetch_models(self, now: float) -> list[str] | None:
        try:
            async with self.session.get(
                self.base_url + "/models",
                headers={k: v for k, v in self._headers.items() if k != "accept"},
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                if resp.status != 200:
                    self._models_failed_at = now
                    return None
                data = orjson.loads(await resp.read())
            self._models = [m["id"] for m in data["data"]]
            self._models_at = now
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError, KeyError, TypeError):
            log.warning("upstream %s: could not list its models", self.name)
            self._models_failed_at = now
            return None
        return self._models


async def read_bounded(resp: aiohttp.ClientResponse, limit: int = MAX_RESPONSE_BYTES) -> bytes:
    if resp.content_length is not None and resp.content_length > limit:
        raise GatewayError(502, "Upstream response too large.", code="upstream_response_too_large")
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise GatewayError(
                502, "Upstream response too large.", code="upstream_response_too_large"
            )
        parts.append(chunk)
    return b"".join(parts)
