"""The doctor's procedure: a few traced requests, an output-length sweep, a shared-connection
probe; then findings. `diagnose()` is the programmatic entry point."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenpipe.bench import prompts
from tokenpipe.bench.clients import ChatRequest, SSEClient
from tokenpipe.bench.metrics import RequestRecord
from tokenpipe.doctor import findings as F
from tokenpipe.doctor import inside
from tokenpipe.doctor.fit import ScalingCheck, check_scaling
from tokenpipe.doctor.hol import HolProbe, find_serialised, find_shared_stalls, probe
from tokenpipe.doctor.trace import PHASES, TracedRequest, traced_request


@dataclass(slots=True)
class DoctorOptions:
    url: str
    model: str = "sim-model"
    requests: int = 3
    prompt_tokens: int = 32
    max_tokens: int = 64
    temperature: float | None = None
    headers: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    #: Output lengths (max_tokens) of the sweep; empty: no sweep.
    sweep: list[int] = field(default_factory=lambda: [16, 32, 64, 128])
    sweep_repeats: int = 2
    #: Concurrent streams of the head-of-line probe; 0: no probe.
    hol_streams: int = 4
    h2c: bool = False
    #: Run the shared-connection probe over this gRPC target (host:port) instead of HTTP.
    grpc_url: str | None = None
    thresholds: F.Thresholds = field(default_factory=F.Thresholds)
    timeout_s: float = 300.0


@dataclass(slots=True)
class DoctorReport:
    options: DoctorOptions
    traced: list[TracedRequest]
    #: Index into `traced` of the request the waterfall shows (the median by e2e).
    shown: int | None
    findings: list[F.Finding]
    sweep_points: list[tuple[int, float]] = field(default_factory=list)  # (tokens, e2e ms)
    scaling: ScalingCheck | None = None
    hol: HolProbe | None = None
    notes: list[str] = field(default_factory=list)
    profile_svg: str | None = None

    @property
    def phases_ms(self) -> dict[str, float]:
        if self.shown is None:
            return dict.fromkeys(PHASES, 0.0)
        return self.traced[self.shown].phases_ms()

    def to_json(self) -> dict[str, Any]:
        o = self.options
        shown = self.traced[self.shown].record if self.shown is not None else None
        return {
            "url": o.url,
            "model": o.model,
            "phases_ms": self.phases_ms,
            "total_ms": round(shown.e2e * 1000, 3) if shown and shown.e2e else None,
            "ttft_ms": round(shown.ttft * 1000, 3) if shown and shown.ttft else None,
            "findings": [f.to_json() for f in self.findings],
            "requests": [
                {
                    "index": t.record.index,
                    "ok": t.record.ok,
                    "error": t.record.error,
                    "phases_ms": t.phases_ms(),
                    "output_tokens": t.record.output_tokens,
                    "chunks": len(t.record.chunk_times),
                    "itl_chunk_ms": [round(g * 1000, 3) for g in t.record.itl_chunks()],
                }
                for t in self.traced
            ],
            "output_length": None
            if self.scaling is None
            else {
                "points": [
                    {"output_tokens": n, "e2e_ms": round(ms, 3)} for n, ms in self.sweep_points
                ],
                "slope_ms_per_token": round(self.scaling.fit.slope, 4),
                "intercept_ms": round(self.scaling.fit.intercept, 3),
                "r2": round(self.scaling.fit.r2, 5),
                "slope_low_ms_per_token": self.scaling.slope_low,
                "slope_high_ms_per_token": self.scaling.slope_high,
                "superlinear": self.scaling.superlinear,
                "evidence": self.scaling.evidence,
            },
            "hol": None
            if self.hol is None
            else {
                "transport": self.hol.transport,
                "shared_connection": self.hol.shared_connection,
                "streams": [
                    {
                        "index": r.index,
                        "ok": r.ok,
                        "ttft_ms": _ms(r.ttft),
                        "e2e_ms": _ms(r.e2e),
                        "http_version": r.http_version,
                        "itl_chunk_ms": [round(g * 1000, 3) for g in r.itl_chunks()],
                    }
                    for r in self.hol.records
                ],
                "notes": self.hol.notes,
            },
            "notes": self.notes,
            "profile_svg": self.profile_svg,
        }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


def _request(o: DoctorOptions, i: int, max_tokens: int) -> ChatRequest:
    msgs = prompts.synthetic(o.prompt_tokens, 1, seed=int(time.time() * 1000) + i)[0]
    return ChatRequest(o.model, msgs, max_tokens, o.temperature, dict(o.headers))


async def sweep(o: DoctorOptions) -> list[RequestRecord]:
    """Requests of each output length, one at a time on one kept-alive connection (so the
    network setup is not in the fit), longest and shortest interleaved."""
    order = [n for _ in range(o.sweep_repeats) for n in o.sweep]
    recs = []
    async with SSEClient(o.url, connections=1, api_key=o.api_key, timeout_s=o.timeout_s) as c:
        for i, n in enumerate(order):
            rec = RequestRecord(index=i)
            await c.send(_request(o, 1000 + i, n), rec)
            recs.append(rec)
    return recs


async def diagnose(o: DoctorOptions) -> DoctorReport:
    th = o.thresholds
    traced = [
        await traced_request(
            o.url, _request(o, i, o.max_tokens), api_key=o.api_key, index=i, timeout_s=o.timeout_s
        )
        for i in range(o.requests)
    ]
    ok = [i for i, t in enumerate(traced) if t.record.ok]
    shown = None
    if ok:
        by_e2e = sorted(ok, key=lambda i: traced[i].record.e2e or 0.0)
        shown = by_e2e[len(by_e2e) // 2]
    recs = [t.record for t in traced]
    phases = [t.phases_ms() for t in traced]
    ok_recs = [recs[i] for i in ok]
    ok_phases = [phases[i] for i in ok]
    found: list[F.Finding] = []
    found += F.find_network(phases, th)
    found += F.find_queueing(ok_recs, ok_phases, th)
    found += F.find_slow_first_token(ok_recs, ok_phases, th)
    found += F.find_stalls(ok_recs, th)
    found += F.find_chunking(ok_recs, th)
    report = DoctorReport(o, traced, shown, found)
    for t in traced:
        if not t.record.ok:
            report.notes.append(f"request {t.record.index} failed: {t.record.error}")

    if len(set(o.sweep)) >= 2:
        srecs = await sweep(o)
        pts = [(r.output_tokens, (r.e2e or 0.0) * 1000) for r in srecs if r.ok]
        report.sweep_points = pts
        if len({n for n, _ in pts}) >= 2:
            report.scaling = check_scaling([float(n) for n, _ in pts], [ms for _, ms in pts])
            if report.scaling.superlinear:
                found.append(F.Finding("superlinear_output_scaling", report.scaling.evidence))
        else:
            report.notes.append(
                "output-length sweep: the server returned the same length "
                "for every max_tokens; no fit"
            )
    if o.hol_streams >= 2:
        reqs = [_request(o, 2000 + i, o.max_tokens) for i in range(o.hol_streams)]
        report.hol = await probe(
            o.url, reqs, api_key=o.api_key, h2c=o.h2c, grpc_url=o.grpc_url, timeout_s=o.timeout_s
        )
        found += find_shared_stalls(report.hol, th)
        found += find_serialised(report.hol)
    return report


def summary_line(r: DoctorReport) -> str:
    ph = r.phases_ms
    total = sum(ph[k] for k in PHASES)
    biggest = max(PHASES, key=lambda k: ph[k])
    share = ph[biggest] / total if total else 0.0
    kinds = sorted({f.kind for f in r.findings})
    gateway = inside.largest_gateway_phase(ph)
    return (
        f"{total:.0f} ms end to end; the largest phase is {biggest} "
        f"({ph[biggest]:.0f} ms, {share:.0%})"
        + (
            f"; inside the gateway, {gateway[0].removeprefix('gateway ')}"
            f" ({inside.ms_text(gateway[1])} ms)"
            if gateway is not None
            else ""
        )
        + (f"; findings: {', '.join(kinds)}" if kinds else "; no findings")
    )
