"""One request, timed phase by phase: network phases from aiohttp's `TraceConfig`, generation
phases from the stream (`tokenpipe.bench`), server phases from tokenpipe's headers/comments.

Every traced request opens a fresh connection (no pool, no DNS cache), so DNS, connect and TLS
are measured each time, as a first request from a new client would see them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from tokenpipe.bench.clients import ChatRequest, SSEClient
from tokenpipe.bench.metrics import RequestRecord
from tokenpipe.doctor import inside

#: Client-side phases, in order (keys of `phases_ms`).
PHASES = ("dns", "connect", "tls", "request_sent", "headers", "first_token", "decode", "tail")
#: Server-side phases a tokenpipe server may report (Server-Timing, x-tokenpipe-* headers,
#: `: tokenpipe NAME_ms=...` comments; bench/stream.py names them): the gateway's, then the
#: upstream engine's (`queue` is the engine's; the gateway's queue is `limiter_wait`).
SERVER_PHASES = (
    "edge",
    "admission",
    "context",
    "limiter_wait",
    "upstream_headers",
    "first_token",
    "max_gap",
    "total",
    "queue",
    "prefill",
    "decode",
)


@dataclass(slots=True)
class TracedRequest:
    record: RequestRecord
    marks: dict[str, float] = field(default_factory=dict)  # perf_counter seconds
    tcp_probe_s: float | None = None  # plain TCP connect, to split TLS from connect
    tls: bool = False

    def phases_ms(self) -> dict[str, float]:
        """Client phases (ms) that add up to the request's end-to-end time, plus `server_*`
        phases where the server reported them (these overlap the client ones)."""
        m, r = self.marks, self.record
        start = r.sent_at  # so the phases add up to the e2e time
        dns = _span(m, "dns_start", "dns_end")
        conn_total = _span(m, "conn_start", "conn_end")
        tls = 0.0
        if self.tls and self.tcp_probe_s is not None:
            tls = max(0.0, conn_total - dns - self.tcp_probe_s)
        connect = max(0.0, conn_total - dns - tls)
        ready = m.get("conn_end", start)
        sent = m.get("request_sent", ready)
        headers = r.headers_at if r.headers_at is not None else sent
        first = r.first_token_at if r.first_token_at is not None else headers
        last = r.chunk_times[-1] if r.chunk_times else first
        end = r.end_at if r.end_at is not None else last
        out = {
            "dns": dns,
            "connect": connect,
            "tls": tls,
            # Time waiting for a pooled connection, if any, counts as request_sent.
            "request_sent": max(0.0, sent - start - dns - connect - tls),
            "headers": max(0.0, headers - sent),
            "first_token": max(0.0, first - headers),
            "decode": max(0.0, last - first),
            "tail": max(0.0, end - last),
        }
        res = {k: round(v * 1000.0, 3) for k, v in out.items()}
        for k in SERVER_PHASES:
            if k in r.server_ms:
                res["server_" + k] = round(r.server_ms[k], 3)
        return inside.derive(res)


def _span(m: dict[str, float], a: str, b: str) -> float:
    return max(0.0, m[b] - m[a]) if a in m and b in m else 0.0


def _trace_config(marks: dict[str, float]) -> aiohttp.TraceConfig:
    tc = aiohttp.TraceConfig()
    clock = time.perf_counter

    def mark(name: str, first_only: bool = True) -> Any:
        async def cb(session: Any, ctx: SimpleNamespace, params: Any) -> None:
            if not first_only or name not in marks:
                marks[name] = clock()

        return cb

    tc.on_request_start.append(mark("request_start"))
    tc.on_dns_resolvehost_start.append(mark("dns_start"))
    tc.on_dns_resolvehost_end.append(mark("dns_end"))
    tc.on_connection_create_start.append(mark("conn_start"))
    tc.on_connection_create_end.append(mark("conn_end"))
    tc.on_request_headers_sent.append(mark("request_sent", first_only=False))
    tc.on_request_chunk_sent.append(mark("request_sent", first_only=False))
    return tc


async def tcp_connect_s(host: str, port: int, timeout_s: float = 10.0) -> float | None:
    """Seconds for a plain TCP connect (no TLS), or None if it fails."""
    t0 = time.perf_counter()
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (TimeoutError, OSError):
        return None
    dt = time.perf_counter() - t0
    w.close()
    return dt


async def traced_request(
    url: str,
    req: ChatRequest,
    *,
    api_key: str | None = None,
    index: int = 0,
    timeout_s: float = 300.0,
) -> TracedRequest:
    """Send one streaming request on a fresh connection and time its phases."""
    marks: dict[str, float] = {}
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    probe = None
    if tls:
        port = parts.port or 443
        probe = await tcp_connect_s(parts.hostname or "127.0.0.1", port)
    rec = RequestRecord(index=index, protocol="sse")
    client = SSEClient(
        url,
        connections=1,
        api_key=api_key,
        timeout_s=timeout_s,
        trace_configs=[_trace_config(marks)],
        force_close=True,
    )
    async with client:
        await client.send(req, rec)
    return TracedRequest(rec, marks, probe, tls)
