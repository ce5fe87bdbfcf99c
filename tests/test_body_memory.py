"""The memory request bodies hold while their requests last, bounded (control/bodies.py): a body
is charged an estimate when it arrives (4 bytes a byte, 128 a JSON object or array) and the
sum is bounded by `server.max_body_memory_bytes`; past it a new request gets 503
`server_overloaded` with Retry-After. Before, nothing bounded it: 8 bodies of 4 MiB of empty
content parts (1.4 M objects each, ~200 MiB parsed) took the gateway to 1.7 GiB, and the
limiter's queue holds up to 10,000 requests."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import orjson

from tests import procs
from tests.test_grpc_stream import Stream, _grpc_gateway, _request
from tokenpipe.control.bodies import PER_BYTE, PER_CONTAINER, BodyMemory, estimate
from tokenpipe.errors import GatewayError


def test_a_body_is_charged_by_its_bytes_and_its_brackets() -> None:
    body = b'{"a":[{},{}],"b":"x"}'
    assert estimate(body) == PER_BYTE * len(body) + PER_CONTAINER * 4


def test_past_the_limit_a_body_is_refused_and_a_body_alone_never() -> None:
    memory = BodyMemory(limit=1_000)
    cost = memory.take(5_000)  # more than the limit alone: served, or it never would be
    try:
        memory.take(1)
    except GatewayError as e:
        assert e.status == 503 and e.code == "server_overloaded"
        assert e.headers["Retry-After"] == "1"
    else:
        raise AssertionError("a second body past the limit was taken")
    memory.give(cost)
    assert memory.held == 0
    assert memory.take(400) and memory.take(400) and memory.held == 800


def _chat(content: str, stream: bool = True) -> bytes:
    return orjson.dumps(
        {
            "model": "sim-model",
            "stream": stream,
            "max_tokens": 20,
            "messages": [{"role": "user", "content": content}],
        }
    )


async def test_the_bodies_of_requests_in_flight_are_bounded_end_to_end(tmp_path: Path) -> None:
    """A stream with a 40 KB body holds its charge (~160 KB) while it runs: a second body
    past the 200 KB bound is refused at once; once the stream ends, its charge is back."""
    slow = "[[sim itl_ms=100 output_tokens=20]] " + "w " * 20_000  # ~2 s of stream
    with procs.sim("--ttft-ms", "0") as sim:
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(
            "server: {max_body_memory_bytes: 200000}\n"
            f"upstreams: [{{name: up, url: '{sim.url}/v1'}}]\n"
        )
        with procs.gateway("--config", str(cfg)) as gw:
            url = gw.url + "/v1/chat/completions"
            headers = {"content-type": "application/json"}
            # One connection for the stream and the request after it: the gateway reads that
            # one only once the stream's handler has ended (and given its charge back).
            one = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(connector=one) as s, aiohttp.ClientSession() as o:
                async with s.post(url, data=_chat(slow), headers=headers) as first:
                    assert first.status == 200
                    assert await first.content.readany()  # the stream has begun
                    async with o.post(url, data=_chat("w " * 20_000), headers=headers) as r:
                        refused = (r.status, r.headers.get("Retry-After"), await r.json())
                    rest = await first.read()
                assert rest.endswith(b"data: [DONE]\n\n")
                async with s.post(url, data=_chat("w " * 20_000, False), headers=headers) as r:
                    after = r.status
    assert refused[:2] == (503, "1"), refused
    assert refused[2]["error"]["code"] == "server_overloaded"
    assert after == 200  # the stream's charge was given back when it ended


async def test_grpc_requests_share_the_bound(tmp_path: Path) -> None:
    """A gRPC ChatRequest is charged by its size and its messages (2 M empty messages fit in
    4 MiB, each a dict and a typed struct): while one runs, a second past the bound is an
    Error with status 503, and once the first is done a third is served."""
    slow = "[[sim itl_ms=100 output_tokens=20]] " + "w " * 20_000
    with procs.sim("--ttft-ms", "0") as sim:
        cfg = tmp_path / "gw.yaml"
        cfg.write_text("server: {max_body_memory_bytes: 200000}\n")
        gateway, target = _grpc_gateway(sim, "--config", str(cfg))
        with gateway:
            async with Stream(target) as s:
                await s.outbox.put(_request("first", slow, 20))
                await s.wait(lambda: "delta" in s.kinds("first"))  # it runs
                await s.outbox.put(_request("second", "w " * 20_000, 5))
                await s.wait(lambda: s.finished("second") and s.finished("first"))
                await s.outbox.put(_request("third", "w " * 20_000, 5))
                await s.wait(lambda: s.finished("third"))
    refused = s.inbox["second"][-1]
    assert refused.WhichOneof("kind") == "error" and refused.error.status == 503
    assert s.kinds("first")[-1] == "done" and s.kinds("third")[-1] == "done"
