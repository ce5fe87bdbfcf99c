"""Head-of-line blocking: several streams at once over one shared connection, and stalls that
hit all of them at the same moment.

HTTP/2 (httpx) is tried first: every stream then shares one TCP connection, and a stall common
to all streams points at that connection (a lost packet or a full flow-control window blocks
every stream on it). A server without HTTP/2 (aiohttp speaks HTTP/1.1 only) cannot multiplex;
the streams then go over separate HTTP/1.1 connections from one pool, and a stall common to all
of them points behind the connections: the server's event loop, a shared upstream connection,
or the engine's batch.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenpipe.bench.clients import (
    ChatRequest,
    GrpcClient,
    H2Client,
    ProtocolUnavailable,
    SSEClient,
    grpc_target,
)
from tokenpipe.bench.metrics import RequestRecord
from tokenpipe.doctor import findings as F
from tokenpipe.doctor.findings import Finding, Thresholds, median_chunk_gap, stall_intervals


@dataclass(slots=True)
class HolProbe:
    records: list[RequestRecord]
    transport: str  # e.g. "one HTTP/2 connection" or "4 HTTP/1.1 connections"
    shared_connection: bool
    notes: list[str] = field(default_factory=list)


async def probe(
    url: str,
    reqs: Sequence[ChatRequest],
    *,
    api_key: str | None = None,
    h2c: bool = False,
    try_h2: bool = True,
    grpc_url: str | None = None,
    timeout_s: float = 120.0,
) -> HolProbe:
    """Run `reqs` concurrently: over one gRPC channel when `grpc_url` is given (one HTTP/2
    connection), else over one HTTP/2 connection when the server offers it."""
    n = len(reqs)
    notes: list[str] = []
    if grpc_url:
        try:
            recs = [RequestRecord(index=i, protocol="grpc") for i in range(n)]
            g = GrpcClient(grpc_target(grpc_url), api_key=api_key, timeout_s=timeout_s)
            async with g, asyncio.TaskGroup() as tg:
                for req, rec in zip(reqs, recs, strict=True):
                    tg.create_task(g.send(req, rec))
            return HolProbe(recs, "one gRPC channel (one HTTP/2 connection)", True, notes)
        except ProtocolUnavailable as e:
            notes.append(str(e))
    if try_h2 and not h2c and not url.startswith("https://"):
        # httpx never upgrades http:// to HTTP/2 (h2c needs prior knowledge): skip the attempt.
        notes.append(
            "http:// without --h2c: no HTTP/2 (it needs TLS with ALPN, or prior "
            "knowledge); the streams went over separate HTTP/1.1 connections"
        )
        try_h2 = False
    if try_h2:
        try:
            recs = [RequestRecord(index=i, protocol="h2") for i in range(n)]
            h2 = H2Client(url, connections=1, api_key=api_key, timeout_s=timeout_s, h2c=h2c)
            async with h2, asyncio.TaskGroup() as tg:
                for req, rec in zip(reqs, recs, strict=True):
                    tg.create_task(h2.send(req, rec))
            if all(r.http_version == "HTTP/2" for r in recs):
                return HolProbe(recs, "one HTTP/2 connection", True, notes)
            notes.append(
                "the server did not speak HTTP/2 (answered "
                + ", ".join(sorted({r.http_version or "nothing" for r in recs}))
                + "); the streams went over separate HTTP/1.1 connections instead"
            )
        except ProtocolUnavailable as e:
            notes.append(str(e))
    recs = [RequestRecord(index=i, protocol="sse") for i in range(n)]
    c = SSEClient(url, connections=n, api_key=api_key, timeout_s=timeout_s)
    async with c, asyncio.TaskGroup() as tg:
        for req, rec in zip(reqs, recs, strict=True):
            tg.create_task(c.send(req, rec))
    return HolProbe(recs, f"{n} HTTP/1.1 connections", False, notes)


def find_shared_stalls(p: HolProbe, th: Thresholds, min_share: float = 0.75) -> list[Finding]:
    """A stall is shared when its interval overlaps a stall of at least `min_share` of the
    streams (and at least two)."""
    ok = [r for r in p.records if r.chunk_times]
    med = median_chunk_gap(ok)
    if med is None or len(ok) < 2:
        return []
    stalls = [(r.index, a, b) for r in ok for _, a, b in stall_intervals(r, med, th)]
    need = max(2, math.ceil(min_share * len(ok) - 1e-9))
    origin = min(r.sent_at for r in ok)
    out: list[Finding] = []
    seen: set[int] = set()
    for idx, a, b in sorted(stalls, key=lambda s: s[1]):
        if idx in seen:
            continue
        group = {j for j, a2, b2 in stalls if a2 < b and a < b2}
        if len(group) < need:
            continue
        overlap_a = max(a2 for j, a2, b2 in stalls if j in group and a2 < b and a < b2)
        overlap_b = min(b2 for j, a2, b2 in stalls if j in group and a2 < b and a < b2)
        seen |= group
        where = (
            "they share one connection, so the connection (a lost packet, a full "
            "flow-control window) or the server behind it blocked them all"
            if p.shared_connection
            else "they used separate connections, so the block is behind them: the server's "
            "event loop, a shared upstream connection or the engine's batch"
        )
        out.append(
            Finding(
                "hol_blocking",
                (
                    f"{len(group)} of {len(ok)} concurrent streams over {p.transport} "
                    f"stalled at the same time (together from "
                    f"+{(overlap_a - origin) * 1000:.0f} ms to "
                    f"+{(overlap_b - origin) * 1000:.0f} ms, median chunk gap "
                    f"{med * 1000:.1f} ms): " + where
                ),
            )
        )
    return out


def find_serialised(p: HolProbe) -> list[F.Finding]:
    """Concurrent streams that got their first token only after another one had ended: the
    server ran fewer of them at once than were sent (a queue in front of the engine)."""
    ok = [r for r in p.records if r.ok and r.first_token_at is not None and r.end_at]
    waited = [
        r
        for r in ok
        if any(
            o is not r
            and o.end_at is not None
            and r.first_token_at is not None
            and r.first_token_at > o.end_at
            for o in ok
        )
    ]
    if not waited:
        return []
    worst = max(waited, key=lambda r: r.ttft or 0.0)
    fastest = min((r.ttft or 0.0) for r in ok)
    return [
        F.Finding(
            "queueing",
            (
                f"{len(waited)} of {len(ok)} concurrent streams over {p.transport} got their first "
                f"token only after another stream had finished (TTFT up to "
                f"{(worst.ttft or 0) * 1000:.0f} ms against {fastest * 1000:.0f} ms for the "
                "fastest): "
                "the server runs fewer requests at once than it was sent and queues the rest"
            ),
        )
    ]
