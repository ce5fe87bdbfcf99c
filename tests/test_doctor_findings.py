"""The doctor's rules on made-up timings: each finding fires on its evidence and not without."""

from __future__ import annotations

from tokenpipe.bench import RequestRecord
from tokenpipe.doctor import findings as F
from tokenpipe.doctor.trace import PHASES, TracedRequest


def _rec(ttft: float, gap: float = 0.01, n: int = 20, tokens: int | None = None) -> RequestRecord:
    times = [ttft + i * gap for i in range(n)]
    return RequestRecord(
        sent_at=0.0,
        status=200,
        chunk_times=times,
        end_at=times[-1],
        usage_completion_tokens=tokens if tokens is not None else n,
    )


def _phases(**kw: float) -> dict[str, float]:
    return {**dict.fromkeys(PHASES, 0.0), **kw}


def test_server_reported_queue_time_is_named_queueing_and_prefill_alone_is_not():
    th = F.Thresholds()
    recs = [_rec(0.6)]
    queued = F.find_queueing(recs, [_phases(server_queue=450.0, server_prefill=100.0)], th)
    assert [f.kind for f in queued] == ["queueing"]
    assert "450 ms" in queued[0].evidence
    assert F.find_queueing(recs, [_phases(server_queue=2.0, server_prefill=550.0)], th) == []


def test_response_headers_held_back_are_named_queueing():
    th = F.Thresholds()
    [f] = F.find_queueing([_rec(0.9)], [_phases(headers=800.0, first_token=80.0)], th)
    assert "headers took 800 ms" in f.evidence


def test_slow_dns_and_slow_tls_fire_above_their_thresholds_only():
    th = F.Thresholds()
    slow = [_phases(dns=250.0, connect=20.0, tls=450.0)] * 3
    assert sorted(f.kind for f in F.find_network(slow, th)) == ["slow_dns", "slow_tls"]
    fast = [_phases(dns=3.0, connect=1.0, tls=15.0)] * 3
    assert F.find_network(fast, th) == []


def test_one_token_per_chunk_is_not_chunking():
    th = F.Thresholds()
    assert F.find_chunking([_rec(0.1), _rec(0.1)], th) == []
    [f] = F.find_chunking([_rec(0.1, gap=0.04, n=10, tokens=40)], th)
    assert "4.0 tokens per chunk" in f.evidence


def test_phases_add_up_to_the_end_to_end_time():
    rec = _rec(0.2)
    t = TracedRequest(
        rec,
        {
            "dns_start": 0.001,
            "dns_end": 0.004,
            "conn_start": 0.001,
            "conn_end": 0.010,
            "request_sent": 0.011,
        },
    )
    rec.headers_at = 0.015
    ph = t.phases_ms()
    assert ph["dns"] == 3.0 and ph["connect"] == 6.0 and ph["tls"] == 0.0
    assert ph["first_token"] == 185.0
    assert sum(ph[k] for k in PHASES) == round((rec.e2e or 0) * 1000, 3)


def test_tls_is_the_connection_time_beyond_a_plain_tcp_connect():
    rec = _rec(0.3)
    t = TracedRequest(
        rec,
        {"conn_start": 0.0, "conn_end": 0.120, "request_sent": 0.121},
        tcp_probe_s=0.020,
        tls=True,
    )
    ph = t.phases_ms()
    assert ph["connect"] == 20.0 and ph["tls"] == 100.0


def test_streams_served_one_after_another_are_named_queueing():
    from tokenpipe.doctor.hol import HolProbe, find_serialised

    first = _rec(0.1, n=10)  # ends at 0.19 s
    second = _rec(0.3, n=10)  # its first token after the first stream ended
    [f] = find_serialised(HolProbe([first, second], "2 HTTP/1.1 connections", False))
    assert f.kind == "queueing" and "1 of 2" in f.evidence
    together = [_rec(0.1, n=10), _rec(0.12, n=10)]
    assert find_serialised(HolProbe(together, "2 HTTP/1.1 connections", False)) == []
