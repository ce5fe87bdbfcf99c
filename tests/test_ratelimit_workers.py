"""`serve --workers N` with the memory backend: N processes on one port, each holding 1/N of
a configured limit, so together they keep the limit (not N times it)."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from tests import procs
from tests.test_ratelimit_gateway import offer


async def test_two_workers_on_one_port_keep_a_configured_limit_together(tmp_path: Path) -> None:
    rate, depth, seconds = 10.0, 2.0, 6.0  # 600 rpm, 2 s deep, 6 s at 3x
    cfg = tmp_path / "tokenpipe.yaml"
    cfg.write_text(
        "limits:\n  queue_deadline_seconds: 2\n"
        "  upstreams:\n    upstream0: {rpm: 600, bucket_seconds: 2}\n"
    )
    # This sim enforces nothing and sends no rate-limit headers: only the config limits.
    with procs.sim("--ttft-ms", "20", "--itl-ms", "1") as sim:
        with procs.gateway(
            "--upstream", sim.url + "/v1", "--config", str(cfg), "--workers", "2"
        ) as gw:
            outcomes = await offer([gw.url], 3 * rate, seconds)
            workers = [line for line in gw.output().splitlines() if "listening on" in line]
        async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/stats?last=100000") as r:
            started = sorted(x["started"] for x in (await r.json())["records"])
    allowed = rate * (started[-1] - started[0]) + rate * depth + 1
    print(len(started), allowed, outcomes, workers)
    assert len(workers) == 2  # two processes listening (same port)
    assert len(started) <= 1.02 * allowed, (len(started), allowed)  # not 2x the limit
    assert len(started) >= 0.85 * allowed, (len(started), allowed)  # and both take work
