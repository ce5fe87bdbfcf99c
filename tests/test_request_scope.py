"""The request path's order and bounds on real loopback sockets (gateway and sims as processes):
one deadline scope bounds every wait, the limiter queue included; a key's quota is checked
before any context work; the context hop's summary call goes through the router's policy.
(The bounded recovery record is tested in-process: tests/test_relay_record.py, and recovery
off once it overflowed in tests/test_router_unit.py.)"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from tests import procs
from tests.polling import metrics as _metrics
from tests.sse_client import StreamResult
from tokenpipe import sse

SUMMARIZED = "small"  # a model with a small window whose history is summarised
CONTEXT = {
    "margin_tokens": 8,
    "reserve_output_tokens": 64,
    "min_output_tokens": 16,
    "summary_max_tokens": 20,
    "models": [{"name": SUMMARIZED, "window": 600, "policy": "summarize"}],
}


def _config(tmp: Path, config: dict[str, Any]) -> str:
    path = tmp / "gw.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _history(turns: int = 40) -> list[dict[str, str]]:
    """A conversation far longer than SUMMARIZED's window (the sim counts one token a word)."""
    msgs = []
    for t in range(turns):
        msgs.append({"role": "user", "content": " ".join(f"q{t}w{i}" for i in range(18))})
        msgs.append({"role": "assistant", "content": " ".join(f"a{t}w{i}" for i in range(18))})
    msgs.append({"role": "user", "content": "and the last question"})
    return msgs


async def _records(sim: procs.Service) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/stats?last=10000") as r:
        return list((await r.json())["records"])


def _summaries(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["id"].startswith("ctx-summary-")]


async def _read_stream(resp: aiohttp.ClientResponse) -> StreamResult:
    result = StreamResult(resp.status, dict(resp.headers))
    dec = sse.SSEDecoder()
    async for chunk in resp.content.iter_any():
        for ev in dec.feed(chunk):
            if ev.comment:
                continue
            if ev.data == sse.DONE:
                result.done = True
            else:
                result.chunks.append(orjson.loads(ev.data))
    return result


async def test_a_client_deadline_bounds_the_wait_behind_a_full_limiter(tmp_path: Path) -> None:
    """One upstream slot, held by a 4-s stream. A request with a 2-s client deadline queues for
    it: the queue's own deadline is 30 s, the client's scope ends the wait at 2 s with a 504."""
    with procs.sim("--ttft-ms", "5", "--itl-ms", "50") as sim:
        cfg = {
            "upstreams": [{"name": "up", "url": sim.url + "/v1"}],
            "limits": {"adaptive_concurrency": False, "max_concurrency": 1},
        }
        with procs.gateway("--config", _config(tmp_path, cfg)) as gw:
            url = gw.url + "/v1/chat/completions"
            occupy = {
                "model": "sim-model",
                "stream": True,
                "max_tokens": 80,  # 80 tokens 50 ms apart: about 4 s
                "messages": [{"role": "user", "content": "occupy the slot"}],
            }
            queued = {
                "model": "sim-model",
                "stream": True,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "wait for it"}],
            }
            async with aiohttp.ClientSession() as s, s.post(url, json=occupy) as occ:
                # Its headers mean it was sent upstream: it holds the limiter's one permit.
                assert occ.status == 200
                reading = asyncio.create_task(_read_stream(occ))
                t0 = time.monotonic()
                async with s.post(
                    url, json=queued, headers={"x-tokenpipe-deadline-seconds": "2"}
                ) as r:
                    body = await r.json()
                took = time.monotonic() - t0
                assert not reading.done(), "the slot was free before the deadline passed"
                occupied = await asyncio.wait_for(reading, 30)
            records = await _records(sim)
    assert r.status == 504, body
    err = body["error"]
    assert err["code"] == "upstream_timeout"
    assert "the client's deadline of 2 s (x-tokenpipe-deadline-seconds)" in err["message"]
    assert "queued for upstream capacity" in err["message"]
    assert 1.5 < took < 5, took  # the client's 2 s, not the queue's 30 s
    assert len(records) == 1  # the queued request never reached the upstream
    # The stream that held the slot is unaffected.
    assert occupied.status == 200 and occupied.errors == [] and occupied.done
    assert len(occupied.text.split()) == 80


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def test_an_over_quota_key_gets_its_429_before_any_context_work(tmp_path: Path) -> None:
    """A key with one request a minute sends a short request, then a long history that would be
    summarised: the 429 comes first, so the upstream sees neither a summary call nor the
    request. The same history from a key with no quota does get a summary (the control)."""
    with procs.sim("--ttft-ms", "1", "--itl-ms", "0") as sim:
        cfg = {
            "upstreams": [{"name": "up", "url": sim.url + "/v1", "models": [SUMMARIZED]}],
            "auth": {
                "api_keys": [
                    {"name": "limited", "sha256": _sha("sk-limited")},
                    {"name": "free", "sha256": _sha("sk-free")},
                ]
            },
            "keys": {"limited": {"rpm": 1}},
            "context": CONTEXT,
        }
        with procs.gateway("--config", _config(tmp_path, cfg)) as gw:
            url = gw.url + "/v1/chat/completions"

            async def ask(key: str, rid: str, messages: list[dict[str, str]]) -> Any:
                body = {"model": SUMMARIZED, "max_tokens": 5, "messages": messages}
                h = {"authorization": f"Bearer {key}", "x-request-id": rid}
                async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=h) as r:
                    return r.status, dict(r.headers), await r.json()

            short = [{"role": "user", "content": "hi"}]
            status, _, _ = await ask("sk-limited", "quota-first", short)
            assert status == 200  # the key's one request this minute
            status, _, over = await ask("sk-limited", "quota-over", _history())
            after_429 = await _records(sim)
            status_free, headers_free, _ = await ask("sk-free", "quota-free", _history())
            after_free = await _records(sim)
    assert status == 429, over
    assert over["error"]["code"] == "rate_limit_exceeded"
    assert [r["id"] for r in after_429] == ["quota-first"]  # no summary call, no request
    assert _summaries(after_429) == []
    # The control: without the quota, this history is summarised (a call upstream).
    assert status_free == 200
    assert headers_free["x-tokenpipe-context"].endswith("summary=new")
    assert len(_summaries(after_free)) == 1
    assert "quota-free" in {r["id"] for r in after_free}


async def test_a_summary_call_falls_over_to_the_next_upstream_on_a_5xx(tmp_path: Path) -> None:
    """The first upstream answers every request 500: the summary call goes through the router's
    policy (the one retry loop) and falls over to the second, as the request itself does."""
    timing = ("--ttft-ms", "1", "--itl-ms", "0")
    with (
        procs.sim(*timing, "--fault", "status:500@1.0") as bad,
        procs.sim(*timing) as good,
    ):
        cfg = {
            "upstreams": [
                {"name": "bad", "url": bad.url + "/v1", "models": [SUMMARIZED]},
                {"name": "good", "url": good.url + "/v1", "models": [SUMMARIZED]},
            ],
            "context": CONTEXT,
        }
        with procs.gateway("--config", _config(tmp_path, cfg)) as gw:
            body = {"model": SUMMARIZED, "max_tokens": 5, "messages": _history()}
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    gw.url + "/v1/chat/completions",
                    json=body,
                    headers={"x-request-id": "fall-over"},
                ) as r,
            ):
                status, headers, answer = r.status, dict(r.headers), await r.json()
            m = await _metrics(gw)
            bad_records, good_records = await _records(bad), await _records(good)
    assert status == 200, answer
    assert headers["x-tokenpipe-context"].endswith("summary=new")  # not a fallback to truncate
    failed = _summaries(bad_records)
    assert len(failed) == 1 and failed[0]["status"] == 500
    done = _summaries(good_records)
    assert len(done) == 1 and done[0]["status"] == 200 and done[0]["outcome"] == "completed"
    assert failed[0]["id"] == done[0]["id"]  # the same call, sent again
    assert [r["id"] for r in bad_records if r["id"] == "fall-over"] == ["fall-over"]
    assert [r["id"] for r in good_records if r["id"] == "fall-over"] == ["fall-over"]
    # Two retries: the summary call's and the request's.
    assert m['tokenpipe_retries_total{outcome="retried",reason="status_5xx"}'] == 2
    assert m['tokenpipe_context_summaries_total{outcome="new"}'] == 1


async def test_a_summary_past_its_max_tokens_fails_and_is_not_kept(tmp_path: Path) -> None:
    """An upstream that ignores the summary call's max_tokens (here the sim, told by a
    directive in the history) wrote a summary far past it: it was cached (up to 1 MiB
    each, 1,024 of them) and reused, though every use was refused as too long. Now it is
    a failed summary: the request is truncated, and the next one asks again."""
    history = _history()
    for m in history[:66:2]:  # old enough to be summarised, whatever part of them is
        m["content"] = "[[sim output_tokens=400]] " + m["content"]
    with procs.sim("--ttft-ms", "1", "--itl-ms", "0") as sim:
        upstream = {"name": "up", "url": sim.url + "/v1", "models": [SUMMARIZED]}
        cfg = {"upstreams": [upstream], "context": CONTEXT}
        with procs.gateway("--config", _config(tmp_path, cfg)) as gw:
            reports = []
            async with aiohttp.ClientSession() as s:
                for _ in range(2):
                    body = {"model": SUMMARIZED, "max_tokens": 5, "messages": history}
                    async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        reports.append(r.headers["x-tokenpipe-context"])
            m = await _metrics(gw)
            summaries = _summaries(await _records(sim))
    assert all(x.endswith("summary=failed") for x in reports), reports
    assert len(summaries) == 2  # asked again: nothing was kept
    assert all(x["tokens"] == 400 for x in summaries)  # the directive went past max_tokens
    assert m['tokenpipe_context_summaries_total{outcome="failed"}'] == 2
