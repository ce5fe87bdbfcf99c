"""Disconnects, auth, metrics and graceful shutdown, on real processes and sockets."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from tests import procs
from tests.sse_client import post_stream


async def _until(pred: Any, timeout: float, what: str) -> Any:
    """Polls an async predicate until it returns a truthy value (bounded wait, not a sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await pred()
        if value:
            return value
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def _sim_record(sim: procs.Service, request_id: str) -> dict[str, Any] | None:
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/stats?last=1000") as r:
        stats = await r.json()
    for rec in stats["records"]:
        if rec["id"] == request_id:
            return rec  # type: ignore[no-any-return]
    return None


def _raw_stream_request(port: int, request_id: str, content: str) -> socket.socket:
    body = orjson.dumps(
        {
            "model": "sim-model",
            "stream": True,
            "max_tokens": 2000,
            "messages": [{"role": "user", "content": content}],
        }
    )
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nx-request-id: "
        + request_id.encode()
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    return sock


@pytest.mark.parametrize("phase", ["mid-stream", "before-first-token"])
async def test_client_disconnect_cancels_upstream_within_100ms(
    sim: procs.Service, gateway: procs.Service, phase: str
) -> None:
    rid = f"disconnect-{phase}"
    content = "[[sim itl_ms=20]]" if phase == "mid-stream" else "[[sim ttft_ms=20000]]"
    sock = _raw_stream_request(gateway.port, rid, content)
    received = b""
    # mid-stream: wait for content; before-first-token: wait for the role chunk only.
    marker = b'"content":" ' if phase == "mid-stream" else b'"role":"assistant"'
    sock.settimeout(10)
    while marker not in received:
        data = sock.recv(65536)
        assert data, "gateway closed the stream"
        received += data
    closed_at = time.monotonic()
    sock.close()
    rec = await _until(lambda: _rec_done(sim, rid), 5, "the sim to see the disconnect")
    assert rec["outcome"] == "cancelled"
    # Both processes read CLOCK_MONOTONIC, so the sim's timestamp compares with ours.
    assert rec["ended"] - closed_at < 0.100


async def _rec_done(sim: procs.Service, rid: str) -> dict[str, Any] | None:
    rec = await _sim_record(sim, rid)
    return rec if rec and rec["outcome"] != "running" else None


KEY = "sk-test-" + "a1b2c3d4" * 4


@pytest.fixture(scope="module")
def auth_gateway(sim: procs.Service, tmp_path_factory: pytest.TempPathFactory) -> Any:
    cfg = tmp_path_factory.mktemp("auth") / "gw.yaml"
    cfg.write_text(f"""
auth:
  api_keys:
    - name: team-a
      sha256: {hashlib.sha256(KEY.encode()).hexdigest()}
upstreams:
  - name: sim
    url: {sim.url}/v1
    api_key_env: TOKENPIPE_TEST_UPSTREAM_KEY
""")
    with procs.gateway(
        "--config",
        str(cfg),
        "--log-level",
        "debug",
        env={"TOKENPIPE_TEST_UPSTREAM_KEY": "sk-upstream-secret-999"},
    ) as g:
        yield g


@pytest.mark.parametrize("key", [None, "sk-wrong", KEY[:-1]])
def test_requests_without_a_valid_key_get_401(auth_gateway: procs.Service, key: str | None) -> None:
    headers = {"Authorization": ""} if key is None else {}  # None: no key sent at all
    client = openai.OpenAI(
        base_url=auth_gateway.url + "/v1",
        api_key=key or "x",
        max_retries=0,
        default_headers=headers,
    )
    with pytest.raises(openai.AuthenticationError) as e:
        client.chat.completions.create(
            model="sim-model", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.status_code == 401
    assert KEY not in str(e.value.body) and "sk-wrong" not in str(e.value.body)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_valid_key_is_served_and_no_key_is_logged(auth_gateway: procs.Service) -> None:
    client = openai.OpenAI(base_url=auth_gateway.url + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(
        model="sim-model", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
    )
    assert r.usage is not None and r.usage.completion_tokens == 3
    log = auth_gateway.output()
    assert KEY not in log and "sk-upstream-secret-999" not in log


async def test_metrics_count_requests_tokens_and_latency(sim: procs.Service) -> None:
    with procs.gateway("--upstream", sim.url + "/v1") as g:
        for _ in range(3):
            r = await post_stream(
                g.url + "/v1/chat/completions",
                {
                    "model": "sim-model",
                    "stream": True,
                    "max_tokens": 10,
                    "messages": [{"role": "user", "content": "count me"}],
                },
            )
            assert r.done
        async with aiohttp.ClientSession() as s, s.get(g.url + "/metrics") as resp:
            text = await resp.text()
    samples = _samples(text)

    def m(name: str) -> float:
        return samples[_sorted_labels(name)]

    labels = 'api="chat",model="sim-model",upstream="upstream0"'
    assert m(f'tokenpipe_requests_total{{{labels},status="200"}}') == 3
    assert m(f'tokenpipe_tokens_total{{kind="completion",{labels}}}') == 30
    assert m(f'tokenpipe_tokens_total{{kind="prompt",{labels}}}') > 0
    assert m(f"tokenpipe_ttft_seconds_count{{{labels}}}") == 3
    # One gap per pair of content events (several deltas may share an event: see relay.py).
    assert 3 <= m(f"tokenpipe_itl_seconds_count{{{labels}}}") <= 27
    assert m(f"tokenpipe_tpot_seconds_count{{{labels}}}") == 3
    assert m(f"tokenpipe_request_duration_seconds_count{{{labels}}}") == 3
    assert m(f"tokenpipe_inflight_requests{{{labels}}}") == 0
    # The sim's TTFT is 10 ms: the histogram must not have put these under 5 ms.
    assert m(f'tokenpipe_ttft_seconds_bucket{{le="0.005",{labels}}}') == 0


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[_sorted_labels(name)] = float(value)
    return out


def _sorted_labels(name: str) -> str:
    if "{" not in name:
        return name
    base, _, rest = name.partition("{")
    parts = sorted(rest.rstrip("}").split(","))
    return base + "{" + ",".join(parts) + "}"


async def test_sigterm_drains_open_streams_then_exits(sim: procs.Service) -> None:
    g = procs.gateway("--upstream", sim.url + "/v1", "--drain-seconds", "20")
    try:
        body = {
            "model": "sim-model",
            "stream": True,
            "max_tokens": 150,
            "messages": [{"role": "user", "content": "[[sim itl_ms=10]] long answer"}],
        }
        streams = [
            asyncio.create_task(post_stream(g.url + "/v1/chat/completions", body)) for _ in range(5)
        ]
        await _until(lambda: _inflight(g, 5), 10, "five open streams")
        g.signal(signal.SIGTERM)
        results = await asyncio.gather(*streams)
        for r in results:
            assert r.done and not r.errors
            assert len(r.text.split()) == 150  # nothing cut
        assert await asyncio.to_thread(g.wait, 15) == 0
    finally:
        g.stop()
    assert "draining" in g.output()


async def _inflight(g: procs.Service, n: int) -> bool:
    async with aiohttp.ClientSession() as s, s.get(g.url + "/metrics") as r:
        text = await r.text()
    total = sum(v for k, v in _samples(text).items() if k.startswith("tokenpipe_inflight_requests"))
    return total >= n


def test_readme_and_ci_entry_point_exist() -> None:
    root = Path(__file__).parent.parent
    assert "make test" in (root / ".ci/run").read_text()
    readme = (root / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
