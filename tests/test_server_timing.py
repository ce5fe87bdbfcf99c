"""Server-Timing on every API's answer, read with a strict parser (tests/server_timing.py):
the phases known when the headers go out in the header, a stream's rest (first token, longest
gap, total) in one `: tokenpipe ...` comment before its last event, the upstream engine's own
phases mapped in, and errors answered by the gateway timed as far as they got."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict

from tests import procs
from tests import server_timing as st
from tests.local_app import serving
from tokenpipe import sse
from tokenpipe.bench.metrics import RequestRecord
from tokenpipe.bench.stream import StreamRecorder, server_phases_from_headers
from tokenpipe.observe.server_timing import Timing

HEADER_PHASES = ["edge", "admission", "context", "queue", "upstream_headers"]
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def _post(
    url: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=hdrs) as r:
        return r.status, dict(r.headers), await r.read()


def _unary(headers: dict[str, str]) -> dict[str, float]:
    got = st.parse(headers["Server-Timing"])
    assert list(got) == [*HEADER_PHASES, "total"], got
    assert got["total"] >= sum(v for k, v in got.items() if k != "total") - 0.01
    return got


def _stream(
    headers: dict[str, str], raw: bytes, content: bytes
) -> tuple[dict[str, float], dict[str, float]]:
    """(header phases, end-of-stream phases); checks where the comment is: once, after the
    last content event (events holding `content`), before the stream's last event."""
    head = st.parse(headers["Server-Timing"])
    assert list(head) == HEADER_PHASES, head  # no total: the stream has not ended yet
    events = sse.SSEDecoder().feed(raw)
    ours = [i for i, e in enumerate(events) if e.comment and e.data.startswith(b"tokenpipe ")]
    assert len(ours) == 1, [e.data for e in events if e.comment]
    at = ours[0]
    end = st.stream_end(events[at].data)
    deltas = [i for i, e in enumerate(events) if content in e.data]
    assert deltas and max(deltas) < at < len(events) - 1
    # The sim's TTFT is 10 ms, on uvloop's timer: libuv keeps time in whole milliseconds and
    # caches it per loop iteration, so the sleep can end up to 1 ms early by perf_counter.
    assert end["total"] >= end["first_token"] >= 9.0
    assert end["max_gap"] <= end["total"] - end["first_token"]
    # The bench reads both as they are (one format): header phases and the comment's.
    rec = RequestRecord(index=0)
    server_phases_from_headers(CIMultiDict(headers), rec.server_ms)  # as a client has them
    recorder = StreamRecorder(rec)
    recorder.feed(raw, 0.0)
    assert rec.server_ms["limiter_wait"] == head["queue"]
    assert rec.server_ms["first_token"] == end["first_token"]
    return head, end


@pytest.mark.parametrize(
    ("path", "body", "content"),
    [
        ("/v1/chat/completions", CHAT, b'"delta":{"content":"'),
        ("/v1/completions", {"model": "sim-model", "prompt": "hi", "max_tokens": 8}, b'"text":"'),
        (
            "/v1/responses",
            {"model": "sim-model", "input": "hi", "max_output_tokens": 8},
            b"response.output_text.delta",
        ),
        ("/v1/messages", CHAT, b'"text_delta"'),
    ],
)
async def test_unary_and_streamed_answers_of_every_api_carry_server_timing(
    gateway: procs.Service, path: str, body: dict[str, Any], content: bytes
) -> None:
    status, headers, _ = await _post(gateway.url + path, body)
    assert status == 200
    got = _unary(headers)
    assert got["upstream_headers"] >= 9.0  # the sim answers after its TTFT (to 1 ms, above)
    status, headers, raw = await _post(gateway.url + path, {**body, "stream": True})
    assert status == 200
    head, end = _stream(headers, raw, content)
    assert head["upstream_headers"] < end["first_token"]
    if path == "/v1/chat/completions":
        assert raw.endswith(b"data: [DONE]\n\n")  # still the last event


async def test_embeddings_carry_server_timing(gateway: procs.Service) -> None:
    status, headers, _ = await _post(
        gateway.url + "/v1/embeddings", {"model": "sim-model", "input": ["a", "b"]}
    )
    assert status == 200
    _unary(headers)


async def test_errors_answered_by_the_gateway_are_timed_as_far_as_they_got(
    gateway: procs.Service,
) -> None:
    url = gateway.url
    status, headers, _ = await _post(url + "/v1/chat/completions", b"{not json")
    assert status == 400 and list(st.parse(headers["Server-Timing"])) == ["total"]
    for path in ("/v1/chat/completions", "/v1/messages"):  # OpenAI's and Anthropic's shapes
        status, headers, _ = await _post(url + path, {**CHAT, "model": "no-such-model"})
        assert status == 404
        got = st.parse(headers["Server-Timing"])
        assert "edge" in got and "total" in got and "queue" not in got, got
    # The upstream's own error, passed on: it got as far as the upstream's headers.
    ask = {**CHAT, "messages": [{"role": "user", "content": "[[sim fault=status:400]] hi"}]}
    status, headers, _ = await _post(url + "/v1/chat/completions", ask)
    assert status == 400
    assert list(st.parse(headers["Server-Timing"])) == [*HEADER_PHASES, "total"]


async def test_a_stream_cut_by_the_gateway_has_its_timing_before_the_error_event(
    gateway: procs.Service,
) -> None:
    ask = {
        **CHAT,
        "stream": True,
        "messages": [{"role": "user", "content": "[[sim fault=garbage]] hi"}],
    }
    status, _, raw = await _post(gateway.url + "/v1/chat/completions", ask)
    assert status == 200 and b"[DONE]" not in raw
    events = sse.SSEDecoder().feed(raw)
    assert b'"error"' in events[-1].data
    assert events[-2].comment
    end = st.stream_end(events[-2].data)
    assert "first_token" not in end  # no token was sent


@pytest.fixture
async def limited(sim: procs.Service, tmp_path: Path) -> AsyncIterator[procs.Service]:
    """One request a minute to the sim, and 0.2 s of waiting for it at most."""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"upstreams:\n  - {{name: sim, url: '{sim.url}/v1'}}\n"
        "limits:\n  queue_deadline_seconds: 0.2\n  upstreams:\n    sim: {rpm: 1}\n"
    )
    with procs.gateway("--config", str(cfg)) as g:
        yield g


async def test_a_429_from_the_limiter_shows_the_phases_before_the_wait(
    limited: procs.Service,
) -> None:
    url = limited.url + "/v1/chat/completions"
    assert (await _post(url, CHAT))[0] == 200
    status, headers, _ = await _post(url, CHAT)
    assert status == 429 and "Retry-After" in headers
    got = st.parse(headers["Server-Timing"])
    assert list(got) == ["edge", "admission", "context", "total"], got
    # It waited the queue deadline (200 ms), less up to 1 ms: libuv's timers run on a clock
    # read in whole milliseconds at each loop turn (a CI run saw 199.782).
    assert got["total"] >= 199.0


class Engine:
    """An upstream that reports its own phases the way `tokenpipe local` does (one of them
    broken: it must not reach Server-Timing)."""

    TIMING = {
        "x-tokenpipe-queue-ms": "3.5",
        "x-tokenpipe-prefill-ms": "12",
        "x-tokenpipe-decode-ms": "nan",
    }

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            answer = {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
            return web.json_response(answer, headers=self.TIMING)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
        }
        await resp.write(sse.encode(orjson.dumps(chunk)))
        await resp.write(b": tokenpipe queue_ms=1.5 prefill_ms=2.5 decode_ms=3.5\n\n")
        await resp.write(sse.DONE_EVENT)
        await resp.write_eof()
        return resp


async def test_the_upstream_engines_phases_are_mapped_in(tmp_path: Path) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", Engine().chat)
    async with serving(app) as upstream:
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(f"upstreams:\n  - {{name: e, url: '{upstream}/v1', models: ['m']}}\n")
        with procs.gateway("--config", str(cfg)) as g:
            url = g.url + "/v1/chat/completions"
            status, headers, _ = await _post(url, {**CHAT, "model": "m"})
            status2, _, raw = await _post(url, {**CHAT, "model": "m", "stream": True})
    assert status == 200
    got = st.parse(headers["Server-Timing"])
    assert list(got) == [*HEADER_PHASES, "upstream_queue", "prefill", "total"], got
    assert (got["upstream_queue"], got["prefill"]) == (3.5, 12.0)
    for name, value in Engine.TIMING.items():  # the x- headers stay, as the engine sent them
        assert headers[name] == value
    # A stream: the engine's comment is relayed as it came, the gateway's follows it.
    assert status2 == 200
    comments = [e.data for e in sse.SSEDecoder().feed(raw) if e.comment]
    assert comments[0] == b"tokenpipe queue_ms=1.5 prefill_ms=2.5 decode_ms=3.5"
    st.stream_end(comments[1])
    rec = RequestRecord(index=0)
    StreamRecorder(rec).feed(raw, 0.0)
    assert {"queue", "prefill", "decode", "first_token", "max_gap", "total"} <= set(rec.server_ms)


def test_the_header_is_built_from_the_marks_and_only_plausible_engine_values() -> None:
    t = Timing(10.0)
    assert t.header() == ""
    assert t.header(10.5) == "total;dur=500.000"
    t.opened, t.admitted, t.prepared = 10.001, 10.0015, 10.003
    t.queue, t.upstream_headers = 0.25, 0.0123456
    engine = {
        "x-tokenpipe-queue-ms": "1e400",  # inf
        "x-tokenpipe-prefill-ms": "-1",
        "x-tokenpipe-decode-ms": "7.25",
    }
    got = st.parse(t.header(11.0, engine))
    assert got == {
        "edge": 1.0,
        "admission": 0.5,
        "context": 1.5,
        "queue": 250.0,
        "upstream_headers": 12.346,
        "decode": 7.25,
        "total": 1000.0,
    }
    for junk in ("abc", "9" * 40, "nan", ""):
        assert "decode" not in t.header(0.0, {"x-tokenpipe-decode-ms": junk})
    assert st.stream_end(t.stream_end(None, 0.0, 10.2)[2:-2]) == {"max_gap": 0.0, "total": 200.0}
