"""Push delivery of a streamed body (upstream/push.py) on a real aiohttp response from the sim:
what the callback takes never reaches the reading task, what it declines does, in order."""

from __future__ import annotations

import aiohttp
import orjson
from aiohttp.streams import StreamReader

from tests import procs
from tokenpipe import sse
from tokenpipe.upstream import push


async def test_taken_and_declined_pieces_add_up_to_the_body_in_order(sim: procs.Service) -> None:
    body = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": 60,
        "messages": [{"role": "user", "content": "[[sim itl_ms=1]] push"}],
    }
    async with aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/v1/chat/completions", json=body) as r:
            reference = await r.read()
        async with s.post(sim.url + "/v1/chat/completions", json=body) as r:
            taken: list[bytes] = []
            order: list[tuple[str, bytes]] = []

            def take(data: bytes) -> bool:
                if len(taken) % 2 == 0:  # every other offer is taken
                    taken.append(data)
                    order.append(("taken", data))
                    return True
                taken.append(b"")  # declined: counts as an offer
                return False

            assert push.attach(r, take)
            assert type(r.content) is not StreamReader
            read: list[bytes] = []
            while chunk := await r.content.readany():
                read.append(chunk)
                order.append(("read", chunk))
            push.detach(r)
            assert type(r.content) is StreamReader
    assert any(t for t in taken) and read  # both paths were used
    # The task read exactly what was declined, and nothing was lost, duplicated or reordered
    # (the same seeded answer as the reference request, whose ids and times differ).
    got = sse.SSEDecoder().feed(b"".join(data for _, data in order))
    want = sse.SSEDecoder().feed(reference)
    assert [_choices(e.data) for e in got] == [_choices(e.data) for e in want]
    assert got[-1].data == sse.DONE and len(got) > 60


def _choices(data: bytes) -> object:
    return data if data == sse.DONE else orjson.loads(data)["choices"]


async def test_other_kinds_of_body_are_left_alone(sim: procs.Service) -> None:
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/v1/models") as r:
        await r.read()
        if type(r.content) is StreamReader:  # a read body is still a plain reader: attachable
            assert push.attach(r, lambda data: False)
            push.detach(r)
        assert type(r.content) is StreamReader
