"""The event loop's time each key's request bodies take to parse, bounded (control/bodies.py
`ParseTime`, `server.max_parse_share_per_key`): a body of 10,000 JSON objects and arrays or
more is charged its estimated parse time before it is parsed, and past its key's share it
gets 429 with Retry-After. Before, a client with a valid key could send 4 MiB bodies of
small containers (~110 ms of the loop each, against 7 ms for text) as fast as it liked, and
every other request waited behind their parses."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests import procs
from tests.polling import metrics
from tokenpipe.clock import ManualClock
from tokenpipe.control import bodies
from tokenpipe.control.bodies import PARSE_BURST_SECONDS, ParseTime
from tokenpipe.errors import GatewayError


def test_a_key_past_its_share_is_refused_until_it_refills_and_others_are_not() -> None:
    clock = ManualClock()
    parsing = ParseTime(0.25, clock)
    for _ in range(5):  # a burst of 0.5 s: five bodies of 0.1 s
        parsing.charge("alice", 0.1)
    with pytest.raises(GatewayError) as e:
        parsing.charge("alice", 0.1)
    assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
    assert "try again in 0.4 s" in e.value.message  # 0.1 s at 0.25 s a second
    assert e.value.headers["Retry-After"] == "1"  # whole seconds, rounded up
    parsing.charge("bob", 0.1)  # another key has its own share
    clock.advance(0.4)
    parsing.charge("alice", 0.1)


def test_a_body_larger_than_the_burst_is_served_once_and_leaves_a_debt() -> None:
    clock = ManualClock()
    parsing = ParseTime(0.5, clock)
    parsing.charge("alice", 3 * PARSE_BURST_SECONDS)  # alone: served, or it never would be
    with pytest.raises(GatewayError) as e:
        parsing.charge("alice", 0.01)
    # The debt stops at two bursts (control/bucket.py): 1 s deep, refilled at 0.5 s a second.
    assert "try again in 2 s" in e.value.message  # (1 + 0.01) / 0.5


def test_the_estimate_follows_the_containers_not_the_bytes() -> None:
    text = b'{"messages":[{"content":"' + b"a " * 2_000_000 + b'"}]}'
    junk = b'{"x":[' + b",".join([b"[]"] * 1_300_000) + b"]}"
    assert len(text) > len(junk)
    assert bodies.containers(text) < bodies.PARSE_FREE_CONTAINERS  # never charged
    cost = bodies.parse_seconds(bodies.containers(junk))
    assert 0.08 < cost < 0.2  # hostile_cost.py --case body: ~0.11 s measured


@pytest.mark.parametrize("seed", range(4))
def test_brackets_found_one_by_one_count_as_a_scan_would(seed: int) -> None:
    """Bodies on both sides of FIND_FROM_BYTES, with brackets few, past FIND_AT_MOST, and
    at the very start and end: the count is exact either way."""
    rng = random.Random(seed)
    for _ in range(300):
        size = rng.choice([0, 1, bodies.FIND_FROM_BYTES - 1, bodies.FIND_FROM_BYTES])
        size += rng.randrange(3 * bodies.FIND_FROM_BYTES) if rng.random() < 0.5 else 0
        dense = rng.choice([0.0, 0.001, 0.01, 0.3])
        body = bytearray(rng.choice(b'ab \\"') for _ in range(size))
        for i in range(size):
            if rng.random() < dense:
                body[i] = rng.choice(b"{[")
        if size and rng.random() < 0.3:
            body[0], body[-1] = ord("{"), ord("[")
        data = bytes(body)
        assert bodies.containers(data) == data.count(b"{") + data.count(b"["), (seed, size)


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def test_a_key_sending_costly_bodies_is_refused_and_another_key_is_served(
    tmp_path: Path,
) -> None:
    junk = (
        orjson.dumps(
            {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        )[:-1]
        + b',"x":['
        + b",".join([b"[]"] * 1_300_000)
        + b"]}"
    )
    small = orjson.dumps(
        {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    )
    per_body = bodies.parse_seconds(bodies.containers(junk))
    served_first = int(PARSE_BURST_SECONDS // per_body)  # those the burst admits
    with procs.sim("--ttft-ms", "0") as sim:
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(
            "server: {max_parse_share_per_key: 0.001}\n"
            "auth:\n  api_keys:\n"
            f"    - {{name: alice, sha256: {_sha('sk-alice')}}}\n"
            f"    - {{name: bob, sha256: {_sha('sk-bob')}}}\n"
            f"upstreams: [{{name: up, url: '{sim.url}/v1'}}]\n"
        )
        with procs.gateway("--config", str(cfg)) as gw:
            url = gw.url + "/v1/chat/completions"

            async def post(key: str, body: bytes) -> tuple[int, str | None, bytes]:
                headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(url, data=body, headers=headers) as r,
                ):
                    return r.status, r.headers.get("Retry-After"), await r.read()

            statuses = [(await post("sk-alice", junk))[0] for _ in range(served_first)]
            refused = await post("sk-alice", junk)
            other = await post("sk-bob", junk)
            alice_small = await post("sk-alice", small)
            counted = await metrics(gw)
    assert statuses == [200] * served_first
    assert refused[0] == 429 and float(refused[1] or 0) > 10, refused[:2]
    assert orjson.loads(refused[2])["error"]["code"] == "rate_limit_exceeded"
    assert other[0] == 200  # bob's share is his own
    assert alice_small[0] == 200  # a body of few containers is never charged
    assert counted['tokenpipe_admission_rejected_total{reason="parse"}'] == 1
