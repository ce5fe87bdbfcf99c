"""The sim (engines/sim/) against clients that tests and benchmarks are made of: a body that
arrives in many reads, and clients that go away mid-answer (a hedge's loser)."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import aiohttp
import orjson

from tests import procs


def _post(body: bytes) -> bytes:
    return b"POST /v1/chat/completions HTTP/1.1\r\nhost: sim\r\ncontent-length: %d\r\n\r\n" % len(
        body
    )


async def test_a_body_larger_than_one_read_is_accepted(sim: procs.Service) -> None:
    prompt = "word " * 60_000  # 300 KB
    body = orjson.dumps(
        {"model": "sim-model", "max_tokens": 3, "messages": [{"role": "user", "content": prompt}]}
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    try:
        writer.write(_post(body))
        for i in range(0, len(body), 30_000):  # a slow client: ten pieces, paced
            writer.write(body[i : i + 30_000])
            await writer.drain()
            await asyncio.sleep(0.01)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        answer = orjson.loads(await reader.readexactly(length))
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 200"), answer
    assert answer["usage"]["prompt_tokens"] >= 60_000


async def _stats(url: str) -> dict[str, object]:
    async with aiohttp.ClientSession() as http, http.get(url + "/sim/stats?last=0") as r:
        data: dict[str, object] = await r.json()
        return data


async def test_clients_that_go_away_mid_stream_leave_no_traceback() -> None:
    n = 30
    with procs.sim("--ttft-ms", "0") as s:
        for i in range(n):
            itl = (0, 1, 5)[i % 3]  # big writes, and writes paced by tokens
            body = orjson.dumps(
                {
                    "model": "sim-model",
                    "stream": True,
                    "max_tokens": 3000,
                    "messages": [{"role": "user", "content": f"[[sim itl_ms={itl}]] x"}],
                }
            )
            sock = socket.create_connection(("127.0.0.1", s.port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(_post(body) + body)
            sock.settimeout(10)
            assert sock.recv(300)  # the stream began
            if i % 2:  # half with a reset (a cancelled hedge), half with a FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        async with asyncio.timeout(10):
            while (stats := await _stats(s.url))["active"] or stats["requests"] != n:
                await asyncio.sleep(0.05)
    assert stats["outcomes"] == {"cancelled": n}
    out = s.output()
    assert "Traceback" not in out and "ClientConnectionResetError" not in out, out[-2000:]


async def test_a_responses_request_with_broken_tools_is_a_400(sim: procs.Service) -> None:
    # Found by the gateway's fuzz test through a native /v1/responses: the sim echoes `tools`
    # into its response object and answered 500 on `tools: [null]`.
    body = {"model": "sim-model", "input": "hi", "tools": [None]}
    async with (
        aiohttp.ClientSession() as http,
        http.post(sim.url + "/v1/responses", json=body) as r,
    ):
        assert r.status == 400, await r.text()


async def test_a_sim_with_n_slots_refuses_the_next_request_while_n_answer() -> None:
    """`--max-active 1`: while one stream answers, a chat request gets 503 and a Messages
    request 529 (overloaded); once the stream ends, the next is served."""
    chat = {"model": "sim-model", "stream": True, "max_tokens": 2000, "messages": []}
    with procs.sim("--ttft-ms", "0", "--itl-ms", "5", "--max-active", "1") as s:
        async with aiohttp.ClientSession() as http:
            chat["messages"] = [{"role": "user", "content": "x"}]
            async with http.post(f"{s.url}/v1/chat/completions", json=chat) as held:
                assert held.status == 200 and await held.content.readline()  # answering
                async with http.post(f"{s.url}/v1/chat/completions", json=chat) as r:
                    assert r.status == 503
                    assert (await r.json())["error"]["code"] == "overloaded"
                messages = {"model": "sim-model", "max_tokens": 5, "messages": chat["messages"]}
                async with http.post(f"{s.url}/v1/messages", json=messages) as r:
                    assert r.status == 529
                    assert (await r.json())["error"]["type"] == "overloaded_error"
            async with asyncio.timeout(10):
                while (await _stats(s.url))["active"]:
                    await asyncio.sleep(0.01)
            chat["max_tokens"] = 3
            async with http.post(f"{s.url}/v1/chat/completions", json=chat) as r:
                assert r.status == 200 and b"[DONE]" in await r.read()


async def _answer(
    url: str, path: str, body: object, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + path, json=body, headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None)


_MSG = [{"role": "user", "content": "hi"}]


async def test_an_output_length_out_of_bounds_is_a_400_that_names_it(sim: procs.Service) -> None:
    """The sim draws an answer's words before it starts, with its event loop held: a
    client's max_tokens of 5,000,000 held every other request for 2 s, and 10^9 would take
    the host's memory. Past MAX_OUTPUT_TOKENS, or not an integer, it is a 400 at once."""
    chat, messages = "/v1/chat/completions", "/v1/messages"
    for bad in (5_000_000, 131_073, -5, "abc", 1.5, True, [1]):
        for path, body in (
            (chat, {"model": "sim-model", "messages": _MSG, "max_tokens": bad, "stream": True}),
            (chat, {"model": "sim-model", "messages": _MSG, "max_completion_tokens": bad}),
            (messages, {"model": "sim-model", "messages": _MSG, "max_tokens": bad}),
            ("/v1/responses", {"model": "sim-model", "input": "hi", "max_output_tokens": bad}),
        ):
            status, answer = await _answer(sim.url, path, body)
            assert status == 400, (path, bad, answer)
            assert "from 0 to 131072" in answer["error"]["message"], (path, bad, answer)
    at_bound = {"model": "sim-model", "messages": _MSG, "max_tokens": 131_072}
    unpaced = {"x-sim-ttft-ms": "0", "x-sim-itl-ms": "0"}  # the whole answer at once
    status, answer = await _answer(sim.url, chat, at_bound, unpaced)
    assert status == 200 and answer["usage"]["completion_tokens"] == 131_072


async def test_timing_overrides_out_of_bounds_are_a_400(sim: procs.Service) -> None:
    """`x-sim-*` headers and `[[sim ...]]` directives set a request's timing: a delay must be
    a finite number of ms up to an hour, an output length within MAX_OUTPUT_TOKENS."""
    body = {"model": "sim-model", "messages": _MSG, "max_tokens": 2}
    for name, value in (
        ("ttft-ms", "nan"),
        ("ttft-ms", "-1"),
        ("itl-ms", "inf"),
        ("itl-ms", "1e99"),
        ("output-tokens", "1000000000"),
    ):
        status, answer = await _answer(
            sim.url, "/v1/chat/completions", body, {f"x-sim-{name}": value}
        )
        assert status == 400, (name, value, answer)
        assert name.replace("-", "_") in answer["error"]["message"], answer
    directive = {
        "model": "sim-model",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "[[sim output_tokens=200000]] hi"}],
    }
    status, answer = await _answer(sim.url, "/v1/chat/completions", directive)
    assert status == 400 and "output_tokens" in answer["error"]["message"], answer


async def test_embeddings_past_their_bounds_are_a_400(sim: procs.Service) -> None:
    """Each number of an embedding is drawn in Python with the loop held: more than 2,048
    inputs, or inputs x dimensions past MAX_VALUES, is a 400, not seconds of the sim's CPU."""
    path = "/v1/embeddings"
    status, _ = await _answer(sim.url, path, {"model": "sim-model", "input": ["a"] * 2049})
    assert status == 400
    big = {"model": "sim-model", "input": ["a"] * 300, "dimensions": 4096}
    status, answer = await _answer(sim.url, path, big)
    assert status == 400 and "1048576" in answer["error"]["message"], answer
    ids = {"model": "sim-model", "input": list(range(5000))}  # one input of token ids
    status, answer = await _answer(sim.url, path, ids)
    assert status == 200 and len(answer["data"]) == 1, answer
