"""Named problems found in timed requests. Pure functions over records, so they are tested on
made-up timings as well as on real runs.

Every finding has a `kind` (one of KINDS) and `evidence` in words, with the numbers behind it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tokenpipe.bench.metrics import RequestRecord
from tokenpipe.doctor import inside

KINDS = (
    "stall",
    "slow_first_token",
    "chunking",
    "queueing",
    "slow_dns",
    "slow_tls",
    "hol_blocking",
    "superlinear_output_scaling",
)


@dataclass(slots=True)
class Finding:
    kind: str
    evidence: str
    request: int | None = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(slots=True)
class Thresholds:
    #: A gap is a stall when it is over `stall_factor` x the median chunk gap and over
    #: `stall_min_ms` (so jitter on a very fast stream is not called a stall).
    stall_factor: float = 8.0
    stall_min_ms: float = 100.0
    #: TTFT (after the network phases) is slow above both of these.
    slow_first_token_ms: float = 500.0
    slow_first_token_factor: float = 20.0  # x the median per-token gap
    #: Median tokens per chunk above which the server batches tokens into chunks.
    chunking_tokens: float = 1.5
    #: Queueing: server-reported queue/limiter wait, or time to response headers, above this
    #: and above `queueing_share` of TTFT.
    queueing_ms: float = 100.0
    queueing_share: float = 0.25
    slow_dns_ms: float = 100.0
    slow_tls_ms: float = 200.0


#: The server's queues a `queueing` finding names (phases_ms key, name).
_QUEUES = (("server_limiter_wait", "gateway queue"), ("server_queue", "engine queue"))


def median_chunk_gap(records: Sequence[RequestRecord]) -> float | None:
    gaps = [g for r in records for g in r.itl_chunks()]
    return statistics.median(gaps) if gaps else None


def median_token_gap(records: Sequence[RequestRecord]) -> float | None:
    gaps = [g for r in records for g, _ in r.itl_tokens()]
    return statistics.median(gaps) if gaps else None


def stall_intervals(
    rec: RequestRecord, median_gap: float, th: Thresholds
) -> list[tuple[int, float, float]]:
    """(chunk number, start, end) of each gap that is a stall (perf_counter seconds)."""
    limit = max(th.stall_factor * median_gap, th.stall_min_ms / 1000.0)
    t = rec.chunk_times
    return [(i, t[i - 1], t[i]) for i in range(1, len(t)) if t[i] - t[i - 1] > limit]


def find_stalls(records: Sequence[RequestRecord], th: Thresholds) -> list[Finding]:
    med = median_chunk_gap(records)
    if med is None:
        return []
    out = []
    for r in records:
        per = r.tokens_per_chunk or 1.0
        for i, a, b in stall_intervals(r, med, th):
            gap = (b - a) * 1000
            out.append(
                Finding(
                    "stall",
                    (
                        f"request {r.index}: no token for {gap:.0f} ms after about token "
                        f"{round(i * per)} (chunk {i}), {gap / (med * 1000):.0f}x the median "
                        f"chunk gap of {med * 1000:.1f} ms"
                    ),
                    r.index,
                )
            )
    return out


def find_slow_first_token(
    records: Sequence[RequestRecord], phases: Sequence[dict[str, float]], th: Thresholds
) -> list[Finding]:
    tok = median_token_gap(records)
    out = []
    for r, ph in zip(records, phases, strict=True):
        if r.ttft is None:
            continue
        network = ph.get("dns", 0) + ph.get("connect", 0) + ph.get("tls", 0)
        wait = r.ttft * 1000 - network
        limit = th.slow_first_token_ms
        if tok:
            limit = max(limit, th.slow_first_token_factor * tok * 1000)
        if wait > limit:
            split = inside.first_token_split(ph)
            server = (
                f"of it: {split}"
                if split is not None
                else ", ".join(
                    f"{k[7:]} {v:.0f} ms" for k, v in ph.items() if k.startswith("server_")
                )
            )
            out.append(
                Finding(
                    "slow_first_token",
                    (
                        f"request {r.index}: first content token {wait:.0f} ms after the "
                        f"connection was ready (TTFT {r.ttft * 1000:.0f} ms)"
                        + (
                            f", {wait / (tok * 1000):.0f}x the per-token gap of {tok * 1000:.1f} ms"
                            if tok
                            else ""
                        )
                        + (
                            (f"; {server}" if split is not None else f"; server reports {server}")
                            if server
                            else ""
                        )
                    ),
                    r.index,
                )
            )
    return out


def find_chunking(records: Sequence[RequestRecord], th: Thresholds) -> list[Finding]:
    ok = [r for r in records if r.ok and len(r.chunk_times) > 1]
    if not ok:
        return []
    per = statistics.median(r.tokens_per_chunk for r in ok)
    if per <= th.chunking_tokens:
        return []
    src = "usage" if all(r.usage_completion_tokens is not None for r in ok) else "chunk counts"
    chunk = median_chunk_gap(ok) or 0.0
    return [
        Finding(
            "chunking",
            (
                f"about {per:.1f} tokens per chunk (tokens from {src}): the client sees a "
                f"chunk every {chunk * 1000:.1f} ms, {chunk * 1000 / per:.1f} ms per token; "
                "ITL per chunk overstates per-token latency by that factor"
            ),
        )
    ]


def find_queueing(
    records: Sequence[RequestRecord], phases: Sequence[dict[str, float]], th: Thresholds
) -> list[Finding]:
    out = []
    for r, ph in zip(records, phases, strict=True):
        ttft_ms = (r.ttft or 0) * 1000
        waited = ph.get("server_queue", 0) + ph.get("server_limiter_wait", 0)
        if waited > th.queueing_ms and waited > th.queueing_share * ttft_ms:
            where = ", ".join(f"{name} {ph[k]:.0f} ms" for k, name in _QUEUES if k in ph)
            out.append(
                Finding(
                    "queueing",
                    (
                        f"request {r.index}: the server reports {waited:.0f} ms queued or "
                        f"waiting for capacity before work began ({where}; "
                        f"{waited / max(ttft_ms, 1e-9):.0%} of TTFT "
                        f"{ttft_ms:.0f} ms)"
                    ),
                    r.index,
                )
            )
        elif (
            ph.get("headers", 0) > th.queueing_ms
            and ph.get("headers", 0) > th.queueing_share * ttft_ms * 2
        ):
            out.append(
                Finding(
                    "queueing",
                    (
                        f"request {r.index}: response headers took {ph['headers']:.0f} ms "
                        f"after the request was sent: the server held the request before "
                        f"starting the stream "
                        f"(a queue or a limiter in front of generation)"
                    ),
                    r.index,
                )
            )
    return out


def find_network(phases: Sequence[dict[str, float]], th: Thresholds) -> list[Finding]:
    out = []
    dns = [p["dns"] for p in phases if p.get("dns")]
    tls = [p["tls"] for p in phases if p.get("tls")]
    if dns and statistics.median(dns) > th.slow_dns_ms:
        out.append(
            Finding(
                "slow_dns",
                (
                    f"DNS resolution took {statistics.median(dns):.0f} ms (median of {len(dns)}); "
                    "a local cache or keep-alive connections avoid it"
                ),
            )
        )
    if tls and statistics.median(tls) > th.slow_tls_ms:
        conn = statistics.median(p.get("connect", 0) for p in phases)
        out.append(
            Finding(
                "slow_tls",
                (
                    f"TLS handshake took {statistics.median(tls):.0f} ms (median) against "
                    f"{conn:.0f} ms for the TCP connect; reuse connections or check TLS 1.3 / "
                    "session resumption"
                ),
            )
        )
    return out
