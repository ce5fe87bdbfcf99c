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


def test_a_gateways_phases_split_a_slow_first_token_and_are_placed_where_they_ran():
    from tokenpipe.doctor import inside

    gateway = {
        "server_edge": 0.5,
        "server_admission": 0.1,
        "server_context": 0.4,
        "server_limiter_wait": 600.0,
        "server_upstream_headers": 2.0,
        "server_first_token": 903.0,
    }
    ph = inside.derive(
        _phases(connect=1.0, request_sent=1.0, headers=604.0, first_token=301.0, **gateway)
    )
    assert ph["server_upstream_first_token"] == 300.0  # 903 less the 603 before it
    assert (
        list(ph).index("server_upstream_first_token")
        == list(ph).index("server_upstream_headers") + 1
    )
    [f] = F.find_slow_first_token([_rec(0.907)], [ph], F.Thresholds())
    assert (
        "of it: network and client 2.0 ms, gateway 601 ms (largest: queue 600 ms), upstream 302 ms"
        in f.evidence
    )
    [q] = F.find_queueing([_rec(0.907)], [ph], F.Thresholds())
    assert "gateway queue 600 ms" in q.evidence
    rows = {r.spec.label: (r.start, r.end) for r in inside.rows(ph)}
    assert rows["gateway edge"] == (2.0, 2.5)  # from the request written
    assert rows["gateway queue"] == (3.0, 603.0)
    assert rows["upstream first token"] == (605.0, 905.0)
    assert inside.largest_gateway_phase(ph) == ("gateway queue", 600.0)
    # An engine behind it: its phases start where the gateway sent the request.
    ph |= {"server_queue": 100.0, "server_prefill": 150.0}
    rows = {r.spec.label: (r.start, r.end) for r in inside.rows(ph)}
    assert rows["engine queue"] == (603.0, 703.0)
    assert rows["engine prefill"] == (703.0, 853.0)
    # Without Server-Timing nothing is drawn and nothing split.
    assert inside.rows(_phases()) == [] and inside.first_token_split(_phases()) is None


def test_a_gateways_phases_under_a_millisecond_are_not_printed_as_zero() -> None:
    from tokenpipe.doctor import inside

    # "inside the gateway, edge (0 ms)" read as if the gateway had reported nothing.
    assert inside.ms_text(0.34) == "0.3"
    assert inside.ms_text(9.96) == "10.0"
    assert inside.ms_text(12.4) == "12"
