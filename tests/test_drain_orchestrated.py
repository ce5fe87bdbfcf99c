"""Shutdown driven as Kubernetes drives it (issue 16.14): SIGTERM; the readiness probe on a
kept-alive connection and on a new one sees 503; new traffic gets 503 with Retry-After; an open
stream is cut at drain_seconds with an error event saying so, its last (no [DONE]); the process
exits."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests import procs

DRAIN = 2.0  # seconds
GRACE = 1.0  # seconds


async def test_sigterm_drains_as_documented_for_orchestrators(tmp_path: Path) -> None:
    # A 30-s stream (300 tokens, 100 ms apart): still open when drain_seconds ends.
    with procs.sim("--ttft-ms", "10", "--itl-ms", "100", "--output-tokens", "300") as sim:
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(
            f"server:\n  drain_seconds: {DRAIN}\n  drain_grace_seconds: {GRACE}\n"
            f"upstreams:\n  - name: sim\n    url: {sim.url}/v1\n"
        )
        with procs.gateway("--config", str(cfg), "--drain-grace-seconds", str(GRACE)) as g:
            body = {
                "model": "sim-model",
                "stream": True,
                "max_tokens": 300,
                "messages": [{"role": "user", "content": "hi"}],
            }
            conn = aiohttp.TCPConnector(limit_per_host=1)  # the probe reuses one kept-alive conn
            async with (
                aiohttp.ClientSession(connector=conn) as probe,
                aiohttp.ClientSession() as client,
            ):
                async with probe.get(g.url + "/readyz") as r:
                    assert r.status == 200
                    await r.read()
                async with client.post(g.url + "/v1/chat/completions", json=body) as stream:
                    assert stream.status == 200
                    await stream.content.readline()  # the stream is open and flowing
                    g.signal(signal.SIGTERM)
                    sent = time.monotonic()
                    await asyncio.sleep(
                        0.3
                    )  # let the signal arrive (not a synchronisation of ours)
                    async with probe.get(g.url + "/readyz") as r:  # the kept-alive connection
                        assert r.status == 503
                        assert (await r.json())["error"]["code"] == "draining"
                    async with (
                        aiohttp.ClientSession() as fresh,  # a new connection
                        fresh.post(g.url + "/v1/chat/completions", json=body) as r,
                    ):
                        assert r.status == 503
                        assert int(r.headers["Retry-After"]) >= 1
                        assert (await r.json())["error"]["code"] == "draining"
                    rest = (await stream.content.read()).decode()
                    cut_at = time.monotonic() - sent
            events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
            assert "[DONE]" not in events  # the error event is the last
            last = orjson.loads(events[-1])
            assert last["error"]["code"] == "shutdown"
            assert "shutting down" in last["error"]["message"]
            assert DRAIN - 0.2 <= cut_at <= DRAIN + 0.8, cut_at
            assert g.wait(5) == 0 or g.proc.returncode is not None
            exited_at = time.monotonic() - sent
            assert exited_at <= DRAIN + 2.0, exited_at


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_ctrl_c_skips_the_grace_but_lets_an_open_stream_finish(
    tmp_path: Path, workers: str
) -> None:
    """SIGINT comes from a terminal (`make run`), where no readiness probe waits for the
    503s: the gateway does not wait `drain_grace_seconds` (here 30 s) but still lets an open
    stream end whole, then exits. SIGTERM waits the grace (the test above). With `--workers`
    the parent passes Ctrl-C on as Ctrl-C (it passed SIGTERM, and the workers waited)."""
    with procs.sim("--ttft-ms", "10", "--itl-ms", "100", "--output-tokens", "10") as sim:
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(
            "server:\n  drain_seconds: 60\n  drain_grace_seconds: 30\n"
            f"upstreams:\n  - name: sim\n    url: {sim.url}/v1\n"
        )
        args = ("--config", str(cfg), "--drain-grace-seconds", "30", "--workers", workers)
        with procs.gateway(*args) as g:
            body = {
                "model": "sim-model",
                "stream": True,
                "max_tokens": 10,
                "messages": [{"role": "user", "content": "hi"}],
            }
            async with (
                aiohttp.ClientSession() as client,
                client.post(g.url + "/v1/chat/completions", json=body) as stream,
            ):
                assert stream.status == 200
                await stream.content.readline()  # open and flowing (~1 s to go)
                g.signal(signal.SIGINT)
                sent = time.monotonic()
                rest = (await stream.content.read()).decode()
            assert rest.rstrip().endswith("data: [DONE]")  # ended whole
            assert g.wait(10) == 0  # (a bound for the failure: the grace is 30 s)
            assert time.monotonic() - sent < 10
