"""Anthropic's Messages API under the gateway's traffic control, on real sockets (gateway and
sims as processes): a slow reader gets merged text deltas with the same text, a client that
leaves closes its upstream stream, a 529 is retried elsewhere (and counts as overload),
hedging bounds a stalled first token. The chat versions: test_backpressure.py,
test_hostile_deadlines.py, test_tail_gateway.py."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import httpx
import orjson
import pytest
from pydantic import TypeAdapter

from tests import procs
from tests.polling import metrics as _metrics
from tests.polling import until as _until
from tests.server_timing import timing_comment
from tests.sse_client import unchunk
from tokenpipe import sse
from tokenpipe.engines.sim import text as sim_text

EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)
ASK: Any = {"model": "sim-model", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def gateway(sim: procs.Service) -> Iterator[procs.Service]:
    with procs.gateway("--upstream", f"anthropic+{sim.url}/v1") as g:
        yield g


def _config(tmp: Path, upstreams: list[tuple[str, str]], tail: str = "") -> str:
    lines = ["upstreams:"]
    for name, url in upstreams:
        lines += [f"  - name: {name}", "    api: anthropic", f"    url: {url}/v1"]
    cfg = tmp / f"gw-{upstreams[0][0]}.yaml"
    cfg.write_text("\n".join(lines) + "\n" + tail)
    return str(cfg)


def _request(content: str, max_tokens: int) -> bytes:
    body = orjson.dumps(
        {
            "model": "sim-model",
            "stream": True,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}],
        }
    )
    return (
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def _text_events(raw: bytes) -> tuple[str, int]:
    """(text, text delta events) of a raw chunked response; every event checked against the
    SDK's types, merged ones included, and all of block 0."""
    text, events = "", 0
    for ev in sse.SSEDecoder().feed(unchunk(raw)):
        if timing_comment(ev):  # the gateway's Server-Timing, its only comment
            continue
        obj = orjson.loads(ev.data)
        assert ev.event == obj["type"]
        if obj["type"] == "ping":
            continue
        EVENT.validate_python(obj)
        if obj["type"] == "content_block_delta":
            assert obj["index"] == 0 and obj["delta"]["type"] == "text_delta"
            text += obj["delta"]["text"]
            events += 1
    return text, events


async def test_slow_reader_gets_the_same_text_in_fewer_text_deltas(gateway: procs.Service) -> None:
    # 2,000 tokens/s from the upstream (~220 KB/s of events as sent). Anthropic's text delta
    # events are small (~110 bytes): the kernel's and the event loop's bounded buffers toward
    # the client hold ~500 of them before the relay sees the client behind and merges, so the
    # answer is long enough for merging to show.
    content = "[[sim itl_ms=0.5 output_tokens=3000]] a long answer please"

    def read(rcvbuf: int | None, pause: float) -> bytes:
        s = socket.socket()
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.connect(("127.0.0.1", gateway.port))
        s.sendall(_request(content, 3000))
        out = b""
        while chunk := s.recv(1024 if pause else 1 << 20):
            out += chunk
            time.sleep(pause)  # the client's own slowness, not synchronisation
        s.close()
        return out

    fast_text, fast_events = _text_events(await asyncio.to_thread(read, None, 0))
    # A reader that renders slowly: 1 KB every 30 ms (~33 KB/s) through a small buffer.
    slow_text, slow_events = _text_events(await asyncio.to_thread(read, 4096, 0.03))
    assert fast_text == "".join(islice(sim_text.words(0, content), 3000))
    assert fast_events > 1500  # a reader that keeps up gets (nearly) every delta as an event
    assert slow_text == fast_text  # byte for byte: nothing lost, reordered or added
    assert slow_events < fast_events / 2, (slow_events, fast_events)  # fewer, larger deltas


async def _sim_active(sim: procs.Service) -> int:
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/stats?last=0") as r:
        return int((await r.json())["active"])


async def test_every_client_disconnect_closes_its_upstream_stream(tmp_path: Path) -> None:
    """Clients leave at random points of streams the sim would send for 8 s (before the
    headers, in message_start, mid-text; by FIN or RST), hedged: within 3 s of the last one
    leaving no upstream stream is open at the sim."""
    tail = "tail:\n  hedging: {budget_ratio: 0.5, initial_delay_seconds: 0.01}\n"
    with (
        procs.sim("--ttft-ms", "30", "--itl-ms", "20") as sim,
        procs.gateway("--config", _config(tmp_path, [("up", sim.url)], tail)) as gw,
    ):
        rng = random.Random(19)
        started = 0

        async def leave() -> None:
            nonlocal started
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(_request("hi", 400))
            await writer.drain()
            want = rng.choice([0, 0, 1, 200, 2000, 6000])
            got = 0
            started += bool(want)
            try:
                if not want:  # before, with or after the headers
                    await asyncio.sleep(rng.random() * 0.06)
                while got < want:
                    chunk = await asyncio.wait_for(reader.read(4096), 10)
                    if not chunk:
                        break
                    got += len(chunk)
            finally:
                sock = writer.get_extra_info("socket")
                if rng.random() < 0.5 and sock is not None:  # RST instead of FIN
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.close()

        await asyncio.gather(*(leave() for _ in range(60)))
        await _until(lambda: _no_streams(sim), 3, "every upstream stream to close")
        assert started > 20
        m = await _metrics(gw)
    inflight = 'tokenpipe_inflight_requests{api="messages",model="sim-model",upstream="up"}'
    assert m.get(inflight, 0) == 0


async def _no_streams(sim: procs.Service) -> bool:
    return await _sim_active(sim) == 0


def test_a_529_is_retried_on_the_next_upstream_and_shrinks_the_concurrency_limit(
    tmp_path: Path,
) -> None:
    with (
        procs.sim("--ttft-ms", "1", "--itl-ms", "0", "--fault", "status:529@1.0") as bad,
        procs.sim("--ttft-ms", "1", "--itl-ms", "0") as good,
        procs.gateway("--config", _config(tmp_path, [("bad", bad.url), ("good", good.url)])) as gw,
        anthropic.Anthropic(base_url=gw.url, api_key="k", max_retries=0) as client,
    ):
        m = client.messages.create(**ASK)
        with client.messages.stream(**ASK) as stream:
            streamed = stream.get_final_message()
        metrics = asyncio.run(_metrics(gw))
        bad_records = httpx.get(bad.url + "/sim/stats").json()["records"]
    assert m.usage.output_tokens == 20 and streamed.usage.output_tokens == 20
    assert [r["status"] for r in bad_records] == [529, 529]
    assert metrics['tokenpipe_retries_total{outcome="retried",reason="status_5xx"}'] == 2
    # Overload, like a 503: the limit of concurrent requests to it went down.
    assert metrics['tokenpipe_concurrency_limit{upstream="bad"}'] < 32


def test_a_529_from_every_upstream_reaches_the_client_as_anthropics_overloaded_error(
    tmp_path: Path,
) -> None:
    with (
        procs.sim("--ttft-ms", "1", "--fault", "status:529@1.0") as sim,
        procs.gateway("--config", _config(tmp_path, [("only", sim.url)])) as gw,
        anthropic.Anthropic(base_url=gw.url, api_key="k", max_retries=0) as client,
    ):
        with pytest.raises(anthropic.OverloadedError) as e:
            client.messages.create(**ASK)
        sent = httpx.get(sim.url + "/sim/stats").json()["requests"]
    assert e.value.status_code == 529
    assert e.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    }
    assert sent == 3  # tail.retries.max_attempts


def test_hedging_bounds_a_stalled_first_token(tmp_path: Path) -> None:
    tail = "tail:\n  hedging: {initial_delay_seconds: 0.2, budget_ratio: 1.0}\n"
    timing = ("--ttft-ms", "20", "--itl-ms", "1")
    with (
        procs.sim(*timing, "--fault", "stall-first:5000@1.0") as stalled,
        procs.sim(*timing) as clean,
        procs.gateway(
            "--config", _config(tmp_path, [("stalled", stalled.url), ("clean", clean.url)], tail)
        ) as gw,
    ):
        body = {**ASK, "stream": True}
        t0 = time.perf_counter()
        ttft = None
        events = []
        with httpx.stream("POST", gw.url + "/v1/messages", json=body, timeout=30) as r:
            dec = sse.SSEDecoder()
            for chunk in r.iter_bytes():
                for ev in dec.feed(chunk):
                    if timing_comment(ev):  # the gateway's Server-Timing, its only comment
                        continue
                    obj = orjson.loads(ev.data)
                    if ttft is None and obj["type"] == "content_block_delta":
                        ttft = time.perf_counter() - t0
                    if obj["type"] != "ping":
                        EVENT.validate_python(obj)
                    events.append(obj)
        metrics = asyncio.run(_metrics(gw))
    assert ttft is not None and ttft < 1.5, ttft  # unhedged: the 5 s stall
    kinds = [e["type"] for e in events]
    assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop"
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "".join(islice(sim_text.words(0, "hi"), 20))
    assert metrics['tokenpipe_hedges_total{outcome="won"}'] == 1


def test_limits_are_learned_from_the_sims_anthropic_headers(tmp_path: Path) -> None:
    from tokenpipe.control.ratelimit_headers import parse_instant

    with (
        procs.sim("--rpm", "600", "--tpm", "100000") as sim,
        procs.sim("--rpm", "1") as tiny,
        procs.gateway("--config", _config(tmp_path, [("up", sim.url)])) as gw,
        anthropic.Anthropic(base_url=gw.url, api_key="k", max_retries=0) as client,
    ):
        direct = httpx.post(sim.url + "/v1/messages", json=ASK)
        for _ in range(3):
            client.messages.create(**ASK)
        metrics = asyncio.run(_metrics(gw))
        assert httpx.post(tiny.url + "/v1/messages", json=ASK).status_code == 200
        limited = httpx.post(tiny.url + "/v1/messages", json=ASK)
    h = direct.headers
    assert (h["anthropic-ratelimit-requests-limit"], h["anthropic-ratelimit-tokens-limit"]) == (
        "600",
        "100000",
    )
    assert not any(name.startswith("x-ratelimit-") for name in h)
    reset = parse_instant(h["anthropic-ratelimit-requests-reset"], time.time())
    assert reset is not None and reset < 1.0  # one request's refill at 10 per second
    # Read by the gateway (the bucket refills at 10 requests a second between these).
    assert 590 <= metrics['tokenpipe_ratelimit_remaining{kind="requests",upstream="up"}'] < 600
    assert metrics['tokenpipe_ratelimit_remaining{kind="tokens",upstream="up"}'] < 100000
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["type"] == "rate_limit_error"


async def test_a_stream_cut_by_shutdown_ends_with_anthropics_error_and_new_ones_get_its_503(
    tmp_path: Path,
) -> None:
    import signal

    with procs.sim("--ttft-ms", "10", "--itl-ms", "100", "--output-tokens", "300") as sim:
        tail = "server:\n  drain_seconds: 1.5\n  drain_grace_seconds: 0.5\n"
        cfg = _config(tmp_path, [("up", sim.url)], tail)
        with procs.gateway("--config", cfg, "--drain-grace-seconds", "0.5") as g:
            body = {**ASK, "max_tokens": 300, "stream": True}
            async with (
                aiohttp.ClientSession() as client,
                client.post(g.url + "/v1/messages", json=body) as stream,
            ):
                assert stream.status == 200
                await stream.content.readline()  # the stream is open and flowing
                g.signal(signal.SIGTERM)
                await asyncio.sleep(0.2)  # let the signal arrive (not a synchronisation of ours)
                async with (
                    aiohttp.ClientSession() as fresh,
                    fresh.post(g.url + "/v1/messages", json=body) as refused,
                ):
                    assert refused.status == 503 and int(refused.headers["Retry-After"]) >= 1
                    assert (await refused.json())["error"]["type"] == "overloaded_error"
                rest = await stream.content.read()
            assert g.wait(5) == 0 or g.proc.returncode is not None
    events = sse.SSEDecoder().feed(rest)
    last = events[-1]
    assert last.event == "error" and b"message_stop" not in rest
    error = orjson.loads(last.data)
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    assert "shutting down" in error["error"]["message"]
