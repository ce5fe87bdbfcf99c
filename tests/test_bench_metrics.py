"""The metric definitions on exact, made-up timings (no network): what TTFT, ITL per chunk and
per token, TPOT and goodput mean, and that sketches merge exactly."""

from __future__ import annotations

import pytest

from tokenpipe.bench import SLO, LatencySketch, RequestRecord, StreamRecorder, parse_slo, summarise


def _record(
    chunks: list[float], tokens: int | None, sent: float = 0.0, end: float | None = None
) -> RequestRecord:
    r = RequestRecord(sent_at=sent, status=200, chunk_times=chunks, usage_completion_tokens=tokens)
    r.end_at = end if end is not None else (chunks[-1] if chunks else sent)
    return r


def test_ttft_is_time_to_first_content_chunk_and_itl_excludes_it():
    r = _record([0.100, 0.110, 0.120, 0.130], tokens=4)
    assert r.ttft == pytest.approx(0.100)
    assert r.itl_chunks() == pytest.approx([0.010, 0.010, 0.010])
    assert r.tpot == pytest.approx(0.030 / 3)


def test_multi_token_chunks_give_per_token_itl_equal_to_gap_over_tokens():
    # 4 chunks 40 ms apart, 16 tokens from usage: 4 tokens per chunk, 10 ms per token.
    r = _record([0.1, 0.14, 0.18, 0.22], tokens=16)
    assert r.tokens_per_chunk == 4
    assert [g for g, _ in r.itl_tokens()] == pytest.approx([0.010] * 3)
    assert [n for _, n in r.itl_tokens()] == [4, 4, 4]
    s = summarise([r]).to_json()
    assert s["itl_chunk_ms"]["p50"] == pytest.approx(40, abs=0.1)
    assert s["itl_token_ms"]["p50"] == pytest.approx(10, abs=0.02)
    assert s["tokens_per_chunk"] == 4


def test_exact_per_chunk_token_counts_are_used_when_the_protocol_gives_them():
    r = _record([0.1, 0.12, 0.16], tokens=None)
    r.chunk_tokens = [1, 2, 4]
    assert r.output_tokens == 7
    assert [g for g, _ in r.itl_tokens()] == pytest.approx([0.010, 0.010])


def test_role_only_first_chunk_is_not_the_first_token():
    rec = RequestRecord(sent_at=0.0)
    s = StreamRecorder(rec)
    role = (
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        b'"finish_reason":null}]}\n\n'
    )
    s.feed(role, 0.001)
    assert rec.chunk_times == []
    s.feed(
        b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n', 0.05
    )
    s.feed(b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}\n\n', 0.06)
    s.feed(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n', 0.07)
    s.feed(
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}\n\n'
        b"data: [DONE]\n\n",
        0.08,
    )
    s.close(0.09)
    assert rec.ok
    assert rec.ttft == pytest.approx(0.05)
    assert rec.chunk_times == pytest.approx([0.05, 0.06, 0.07])
    assert rec.output_tokens == 5
    assert rec.finish_reason == "stop"


def test_stream_without_done_is_a_failed_request_and_server_phases_are_read():
    rec = RequestRecord(sent_at=0.0, status=200)
    s = StreamRecorder(rec)
    s.feed(
        b": tokenpipe queue_ms=12.5 prefill_ms=40 decode_ms=300\n\n"
        b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
        0.1,
    )
    s.close(0.2)
    assert not rec.ok and "DONE" in (rec.error or "")
    assert rec.server_ms == {"queue": 12.5, "prefill": 40.0, "decode": 300.0}


def test_goodput_counts_only_ok_requests_within_every_slo():
    fast = _record([0.05, 0.06, 0.07], tokens=3)
    slow_first = _record([0.9, 0.91, 0.92], tokens=3)
    slow_decode = _record([0.05, 0.5, 0.95], tokens=3)
    failed = RequestRecord(status=500, error="HTTP 500", end_at=0.1)
    slo = parse_slo("ttft=500ms,tpot=50ms")
    assert slo == SLO(ttft=0.5, tpot=0.05)
    s = summarise([fast, slow_first, slow_decode, failed], slo=slo, wall_s=2.0)
    out = s.to_json()
    assert (out["requests_ok"], out["requests_failed"]) == (3, 1)
    assert out["goodput_fraction"] == 0.25
    assert out["goodput"] == 0.5  # 1 good request in 2 s


def test_bad_slo_is_rejected_with_the_accepted_keys():
    with pytest.raises(ValueError, match="ttft="):
        parse_slo("latency=5")


def test_sketches_merge_exactly_across_workers_and_survive_serialisation():
    a, b, both = LatencySketch(), LatencySketch(), LatencySketch()
    for i in range(1, 1001):
        (a if i % 2 else b).record(i / 1000)
        both.record(i / 1000)
    merged = LatencySketch.from_text(a.to_text()).merge(LatencySketch.from_text(b.to_text()))
    assert merged.count == 1000
    assert merged.stats() == both.stats()
    assert merged.quantile_ms(0.5) == pytest.approx(500, rel=0.002)
    assert merged.quantile_ms(0.99) == pytest.approx(990, rel=0.002)


def test_summary_json_has_the_documented_shape():
    s = summarise([_record([0.1, 0.11], tokens=2)]).to_json()
    for k in ("ttft_ms", "itl_token_ms", "itl_chunk_ms", "tpot_ms", "e2e_ms"):
        assert set(s[k]) == {"p50", "p90", "p99", "mean"}
    for k in ("output_tokens_per_s", "requests_ok", "requests_failed", "goodput"):
        assert k in s
