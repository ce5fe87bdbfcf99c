"""A full upstream: a `tokenpipe sim --max-active 2` refuses (503 on chat, 529 on Messages)
while two streams answer. Through the gateway the refused requests wait for a slot again,
outside the retry budget, and every one of them is answered whole (router/attempt.py
MAX_REQUEUES, control/aimd.py `cap`)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import pytest

from tests import procs
from tests.polling import metrics as _metrics

HI = [{"role": "user", "content": "hi"}]
APIS = {
    # api: (the gateway's --upstream prefix, path, what ends a whole stream)
    "chat": ("", "/v1/chat/completions", b"data: [DONE]"),
    "messages": ("anthropic+", "/v1/messages", b"event: message_stop"),
}


def _refused(sim: procs.Service) -> int:
    with urllib.request.urlopen(sim.url + "/sim/stats", timeout=10) as r:
        return int(json.loads(r.read())["outcomes"].get("error", 0))


@pytest.mark.parametrize("api", APIS)
async def test_requests_a_full_upstream_refuses_wait_for_a_slot_and_all_finish(api: str) -> None:
    prefix, path, end = APIS[api]
    with (
        procs.sim("--ttft-ms", "0", "--itl-ms", "10", "--max-active", "2") as sim,
        procs.gateway("--upstream", f"{prefix}{sim.url}/v1") as gw,
    ):
        url = gw.url + path
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            holders = [
                await http.post(
                    url,
                    json={"model": "sim-model", "stream": True, "max_tokens": 30, "messages": HI},
                )
                for _ in range(2)
            ]
            for r in holders:  # both answer: the sim is full, and the gateway knows it
                assert r.status == 200 and await r.content.readline()

            async def whole(r: aiohttp.ClientResponse) -> bytes:
                async with r:
                    assert r.status == 200, await r.text()
                    return await r.read()

            async def one() -> bytes:
                body = {"model": "sim-model", "stream": True, "max_tokens": 5, "messages": HI}
                return await whole(await http.post(url, json=body))

            bodies = await asyncio.gather(*(one() for _ in range(4)), *map(whole, holders))
        m = await _metrics(gw)
        refused = _refused(sim)
    assert all(end in b for b in bodies), bodies
    # The four were refused (one that reaches the gateway after the first refusal waits in
    # the limiter instead: the limit was cut to the two held) ...
    assert refused >= 1
    # ... and each refused one waited for a slot again: no retry budget spent, none failed.
    requeued = m['tokenpipe_retries_total{outcome="requeued",reason="full"}']
    assert 1 <= requeued <= refused, (m, refused)
    assert not any("no_budget" in k for k in m if k.startswith("tokenpipe_retries")), m
    (limit,) = (v for k, v in m.items() if k.startswith("tokenpipe_concurrency_limit{"))
    # Cut from 32 to the two it held; after that each success adds 1/limit (6 at most: < 5).
    assert 2 <= limit < 5, limit
