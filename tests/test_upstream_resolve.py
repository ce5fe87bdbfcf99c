"""An upstream host's addresses looked up once and shared (upstream/resolve.py): real lookups
of `localhost` (/etc/hosts, no network), a hand-driven clock for the TTL, and a pool that
opens many connections at once to a real server by name."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web
from yarl import URL

from tests.local_app import serving
from tokenpipe.clock import ManualClock
from tokenpipe.upstream import h1
from tokenpipe.upstream.resolve import Resolver, is_private


async def test_connections_opened_together_share_one_lookup_until_the_ttl() -> None:
    clock = ManualClock()
    r = Resolver("localhost", 8000, ttl=10.0, clock=clock)
    answers = await asyncio.gather(*(r.addresses() for _ in range(50)))
    assert r.lookups == 1
    assert all(a == answers[0] for a in answers) and answers[0][0][4][1] == 8000
    clock.advance(9.9)
    await r.addresses()
    assert r.lookups == 1  # fresh: the cached answer
    clock.advance(0.2)
    assert await r.addresses() is answers[0]  # expired: served at once, looked up again
    fresh = await r._lookup.do(None, r._resolve)  # joins that lookup, in the background
    assert r.lookups == 2 and fresh is not answers[0]
    assert await r.addresses() is fresh
    clock.advance(9.9)
    assert await r.addresses() is fresh and r.lookups == 2  # fresh again for a TTL
    r.forget()
    await r.addresses()
    assert r.lookups == 3  # forgotten (no address took a connection): waited for


async def test_a_failed_lookup_in_the_background_leaves_the_answer_it_had() -> None:
    clock = ManualClock()
    r = Resolver("localhost", 8000, ttl=10.0, clock=clock)
    answer = await r.addresses()
    r.port = "no-such-service"  # type: ignore[assignment]  # the next lookup fails
    clock.advance(10)
    assert await r.addresses() is answer
    with pytest.raises(socket.gaierror):
        await r._lookup.do(None, r._resolve)  # (joins the one in flight)
    assert r.lookups == 2
    assert await r.addresses() is answer  # still served, and asked for again
    with pytest.raises(socket.gaierror):
        await r._lookup.do(None, r._resolve)
    assert r.lookups == 3


async def test_a_failed_lookup_is_not_cached() -> None:
    r = Resolver("localhost", "no-such-service")  # type: ignore[arg-type]
    for _ in range(2):
        with pytest.raises(socket.gaierror):
            await r.addresses()
    assert r.lookups == 2


async def test_a_waiter_that_gives_up_leaves_the_lookup_to_the_others() -> None:
    r = Resolver("localhost", 8000)
    first = asyncio.create_task(r.addresses())
    second = asyncio.create_task(r.addresses())
    await asyncio.sleep(0)  # both are waiting on the one lookup
    first.cancel()
    assert (await second)[0][4][1] == 8000
    assert first.cancelled() and r.lookups == 1


async def test_a_burst_of_new_connections_to_a_named_host_looks_it_up_once() -> None:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", hello)
    async with serving(app) as base:
        url = URL(base).with_host("localhost")
        pool = h1.Pool(url, limit=32, connect_timeout=5.0)
        head = f"GET / HTTP/1.1\r\nHost: {url.host_port_subcomponent}\r\n\r\n".encode()

        async def fetch() -> bytes:
            resp = await pool.request(head, b"", 5.0)
            return await resp.read()

        try:
            assert await asyncio.gather(*(fetch() for _ in range(32))) == [b"hello"] * 32
            assert pool._open == 32  # 32 new connections, all opened together
            assert pool.resolver.lookups == 1
        finally:
            pool.close()


def test_private_addresses_are_this_machine_and_private_networks_only() -> None:
    near = ["127.0.0.1", "10.1.2.3", "172.16.0.9", "192.168.1.1", "169.254.0.5", "::1"]
    near += ["fd12::1", "fe80::1%eth0", "::ffff:10.0.0.1"]
    far = ["8.8.8.8", "104.18.6.192", "2606:4700::6812:6c0", "::ffff:8.8.8.8", "not-an-ip"]
    assert all(is_private(a) for a in near)
    assert not any(is_private(a) for a in far)
