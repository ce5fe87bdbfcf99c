"""Protocol clients for the load generator: one interface, three wires.

- `sse`: aiohttp over HTTP/1.1, raw SSE parse (`StreamRecorder`). The reference client.
- `h2`: httpx with HTTP/2. Over https:// HTTP/2 is negotiated with ALPN; over http:// httpx
  speaks HTTP/1.1 unless `h2c=True` (prior knowledge). Every record notes the HTTP version the
  server answered with, so a fallback to HTTP/1.1 is reported, never hidden.
- `grpc`: `tokenpipe.v1.Chat/ChatStream` with the generated code in `tokenpipe.front.grpc_gen`;
  `ProtocolUnavailable` until that module exists.

`sse` and `h2` speak any API of `apis.py` (`api=`: chat, responses, messages): its endpoint,
body, headers and stream recorder are chosen once per client, so a chat stream costs what it
did before the other APIs existed. gRPC is chat only.
"""

from __future__ import annotations

import time
import uuid
from types import ModuleType
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import orjson

from tokenpipe.bench import apis
from tokenpipe.bench.apis import ChatRequest, Wire, api_url
from tokenpipe.bench.metrics import RequestRecord
from tokenpipe.bench.stream import server_phases_from_headers

PROTOCOLS = ("sse", "h2", "grpc")
#: Bytes of an error body kept in a record (the rest is read and dropped).
MAX_ERROR_BODY = 4096
#: aiohttp's read buffer per connection (bytes); the stream pauses the socket beyond it.
READ_BUFFER = 2**20


class ProtocolUnavailable(RuntimeError):
    """The protocol cannot be used here (a missing module); the message says why."""


class Client(Protocol):
    name: str

    async def __aenter__(self) -> Client: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def send(self, req: ChatRequest, rec: RequestRecord) -> None:
        """Send one streaming request and fill `rec`; never raises for a failed request."""
        ...


def chat_url(url: str) -> str:
    """Accepts a base URL (`http://h:p`, `http://h:p/v1`) or the full endpoint."""
    return api_url("chat", url)


class SSEClient:
    name = "sse"

    def __init__(
        self,
        url: str,
        *,
        connections: int,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        trace_configs: list[aiohttp.TraceConfig] | None = None,
        force_close: bool = False,
        api: str = "chat",
    ) -> None:
        self.wire = Wire(api, url, api_key)
        self.url, self.headers = self.wire.url, self.wire.headers
        self.connections = connections
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30)
        self.trace_configs = trace_configs
        self.force_close = force_close
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SSEClient:
        # limit: connections held at once (requests beyond it wait for one, by aiohttp's pool).
        conn = aiohttp.TCPConnector(
            limit=self.connections,
            force_close=self.force_close,
            use_dns_cache=not self.force_close,
        )
        self.session = aiohttp.ClientSession(
            connector=conn,
            timeout=self.timeout,
            read_bufsize=READ_BUFFER,
            trace_configs=self.trace_configs,
            auto_decompress=False,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    async def send(self, req: ChatRequest, rec: RequestRecord) -> None:
        assert self.session is not None, "use `async with`"
        body = self.wire.body(req)
        headers = {**self.headers, **req.headers} if req.headers else self.headers
        recorder = self.wire.recorder(rec)
        clock = time.perf_counter
        rec.sent_at = clock()
        try:
            async with self.session.post(self.url, data=body, headers=headers) as resp:
                rec.headers_at = clock()
                rec.status = resp.status
                rec.http_version = (
                    f"HTTP/{resp.version.major}.{resp.version.minor}"
                    if resp.version
                    else "HTTP/1.1"
                )
                server_phases_from_headers(resp.headers, rec.server_ms)
                if resp.status != 200:
                    text = await resp.content.read(MAX_ERROR_BODY)
                    rec.error = f"HTTP {resp.status}: {_error_message(text)}"
                    rec.end_at = clock()
                    return
                async for data in resp.content.iter_any():
                    recorder.feed(data, clock())
                recorder.close(clock())
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            rec.error = f"{type(e).__name__}: {e}"
            rec.end_at = clock()


class H2Client:
    name = "h2"

    def __init__(
        self,
        url: str,
        *,
        connections: int,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        h2c: bool = False,
        api: str = "chat",
    ) -> None:
        self.wire = Wire(api, url, api_key)
        self.url, self.headers = self.wire.url, self.wire.headers
        self.connections = connections
        self.timeout_s = timeout_s
        self.h2c = h2c
        self.client: Any = None

    async def __aenter__(self) -> H2Client:
        try:
            import httpx
        except ImportError:
            raise ProtocolUnavailable(
                "h2: httpx[http2] is not installed (pip install 'tokenpipe[bench]')"
            ) from None
        try:
            import h2  # noqa: F401
        except ImportError:
            raise ProtocolUnavailable(
                "h2: the h2 package is missing (pip install 'httpx[http2]')"
            ) from None
        # HTTP/2 multiplexes: a few connections carry all streams.
        limits = httpx.Limits(
            max_connections=self.connections, max_keepalive_connections=self.connections
        )
        self.client = httpx.AsyncClient(
            http2=True,
            http1=not self.h2c,
            limits=limits,
            timeout=httpx.Timeout(self.timeout_s, connect=30.0),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def send(self, req: ChatRequest, rec: RequestRecord) -> None:
        import httpx

        headers = {**self.headers, **req.headers} if req.headers else self.headers
        recorder = self.wire.recorder(rec)
        clock = time.perf_counter
        rec.sent_at = clock()
        try:
            async with self.client.stream(
                "POST", self.url, content=self.wire.body(req), headers=headers
            ) as resp:
                rec.headers_at = clock()
                rec.status = resp.status_code
                rec.http_version = resp.http_version
                server_phases_from_headers(resp.headers, rec.server_ms)
                if resp.status_code != 200:
                    text = b""
                    async for data in resp.aiter_raw():
                        text += data
                        if len(text) >= MAX_ERROR_BODY:
                            break
                    rec.error = f"HTTP {resp.status_code}: {_error_message(text)}"
                    rec.end_at = clock()
                    return
                async for data in resp.aiter_raw():
                    recorder.feed(data, clock())
                recorder.close(clock())
        except (httpx.HTTPError, OSError) as e:
            rec.error = f"{type(e).__name__}: {e}"
            rec.end_at = clock()


def grpc_modules() -> tuple[ModuleType, ModuleType]:
    """(chat_pb2, chat_pb2_grpc), the committed code generated from chat.proto; imported on
    first use so that SSE-only runs never load grpc."""
    from tokenpipe.front.grpc_gen import chat_pb2, chat_pb2_grpc

    return chat_pb2, chat_pb2_grpc


def grpc_target(url: str) -> str:
    """grpc://host:port or host:port as is; an http URL maps to its host and port 50051."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    if parts.scheme == "grpc":
        return parts.netloc
    return f"{parts.hostname or '127.0.0.1'}:50051"


class GrpcClient:
    name = "grpc"

    def __init__(
        self, target: str, *, api_key: str | None = None, timeout_s: float = 600.0
    ) -> None:
        self.target = target
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.timeout_s = timeout_s
        self.channel: Any = None
        self.stub: Any = None
        self.pb2: Any = None

    async def __aenter__(self) -> GrpcClient:
        import grpc

        self.pb2, pb2_grpc = grpc_modules()
        # One channel: gRPC multiplexes every stream over one HTTP/2 connection.
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = pb2_grpc.ChatStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def send(self, req: ChatRequest, rec: RequestRecord) -> None:
        import grpc

        pb2 = self.pb2
        kwargs: dict[str, Any] = {
            "request_id": uuid.uuid4().hex,
            "model": req.model,
            "messages": [pb2.Message(role=m["role"], content=m["content"]) for m in req.messages],
        }
        if req.max_tokens is not None:
            kwargs["max_tokens"] = req.max_tokens
        if req.temperature is not None:
            kwargs["temperature"] = req.temperature
        first = pb2.ClientMessage(request=pb2.ChatRequest(**kwargs))
        clock = time.perf_counter
        rec.http_version = "HTTP/2"
        rec.sent_at = clock()
        call = self.stub.ChatStream(metadata=self.metadata or None, timeout=self.timeout_s)
        try:
            await call.write(first)
            await call.done_writing()
            async for msg in call:
                now = clock()
                if rec.headers_at is None:
                    rec.headers_at = now
                kind = _which(msg)
                if kind == "delta":
                    if msg.delta.content:
                        rec.chunk_times.append(now)
                        rec.chunk_tokens.append(max(1, msg.delta.tokens))
                elif kind == "usage":
                    rec.usage_completion_tokens = msg.usage.completion_tokens
                    rec.usage_prompt_tokens = msg.usage.prompt_tokens
                elif kind == "done":
                    rec.finish_reason = msg.done.finish_reason
                elif kind == "error":
                    rec.status = msg.error.status or 500
                    rec.error = f"{msg.error.type}: {msg.error.message}"
            rec.status = rec.status or 200
            rec.end_at = clock()
            if rec.error is None and rec.finish_reason is None:
                rec.error = "stream ended without done"
        except grpc.aio.AioRpcError as e:
            rec.error = f"gRPC {e.code().name}: {e.details()}"
            rec.end_at = clock()


def _which(msg: Any) -> str | None:
    """The set field of the message's (only) oneof, whatever the proto named it."""
    for o in msg.DESCRIPTOR.oneofs:
        return str(msg.WhichOneof(o.name) or "") or None
    return None


def make_client(
    protocol: str,
    url: str,
    *,
    connections: int,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    h2c: bool = False,
    grpc_url: str | None = None,
    api: str = "chat",
) -> Client:
    """A client of `protocol` speaking `api` (apis.APIS; gRPC: chat only)."""
    apis.check(api)
    if protocol == "sse":
        return SSEClient(
            url, connections=connections, api_key=api_key, timeout_s=timeout_s, api=api
        )
    if protocol == "h2":
        return H2Client(
            url,
            connections=max(1, min(connections, 8)),
            api_key=api_key,
            timeout_s=timeout_s,
            h2c=h2c,
            api=api,
        )
    if protocol == "grpc":
        if api != "chat":
            raise ValueError(f"grpc speaks chat only, not {api!r}")
        grpc_modules()  # fail early, with the reason
        return GrpcClient(grpc_target(grpc_url or url), api_key=api_key, timeout_s=timeout_s)
    raise ValueError(f"unknown protocol {protocol!r}: use one of {', '.join(PROTOCOLS)}")


def _error_message(body: bytes) -> str:
    try:
        obj = orjson.loads(body)
        return str(obj["error"]["message"])[:300]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:300].decode("utf-8", "replace")


__all__ = [
    "PROTOCOLS",
    "ChatRequest",
    "Client",
    "GrpcClient",
    "H2Client",
    "ProtocolUnavailable",
    "SSEClient",
    "chat_url",
    "grpc_modules",
    "make_client",
]
