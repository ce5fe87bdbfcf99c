"""How long idle upstream connections stay open (upstream/h1.py's `reap`), against a raw
loopback server that keeps every connection until the pool closes it: all but the warm ones
close after `keepalive_s`, the warm ones after `warm_s` and with TCP keep-alive probes in the
meantime, each with a FIN (not a reset), and the reaper runs by itself."""

from __future__ import annotations

import asyncio
import socket

from tests.test_upstream_h1 import _get_head, _read_head, raw_server
from tokenpipe.settings import UpstreamSettings
from tokenpipe.upstream import h1
from tokenpipe.upstream.http import HttpUpstream

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class Upstream:
    """Answers every request on a connection until the client closes it; records each
    connection's end: "fin" (a close) or "reset" (an abort)."""

    def __init__(self) -> None:
        self.accepted = 0
        self.ends: list[str] = []
        self._changed = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while True:
                await _read_head(reader)
                writer.write(OK)
                await writer.drain()
        except asyncio.IncompleteReadError:
            self.ends.append("fin")
        except ConnectionError:
            self.ends.append("reset")
        finally:
            writer.close()
            self._changed.set()

    async def ended(self, n: int) -> list[str]:
        """The connections' ends once `n` have ended (bounded wait: 5 s)."""
        async with asyncio.timeout(5):
            while len(self.ends) < n:
                self._changed.clear()
                await self._changed.wait()
        return self.ends


async def _get(pool: h1.Pool) -> None:
    resp = await pool.request(_get_head(), b"", 5.0)
    assert await resp.read() == b"ok"


def _probing(pool: h1.Pool) -> list[int]:
    """SO_KEEPALIVE of each idle connection, oldest first."""
    out = []
    for conn in pool._idle:
        assert conn.transport is not None
        sock = conn.transport.get_extra_info("socket")
        out.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE))
    return out


async def test_idle_connections_close_after_keepalive_but_the_warm_ones_later() -> None:
    up = Upstream()
    now = [0.0]  # keepalive_s: 30 (the default)
    async with raw_server(up.handle) as url:
        pool = h1.Pool(url, limit=8, connect_timeout=5.0, warm=2, warm_s=300, clock=lambda: now[0])
        try:
            await asyncio.gather(*(_get(pool) for _ in range(4)))  # 4 connections, idle at 0
            assert up.accepted == 4
            now[0] = 29.0
            pool.reap()
            assert up.ends == [] and len(pool._idle) == 4

            now[0] = 31.0
            pool.reap()  # the 2 oldest close; the 2 warmest stay, probed
            assert await up.ended(2) == ["fin", "fin"]
            assert _probing(pool) == [1, 1]

            now[0] = 200.0  # a request after a quiet spell: a warm connection, no new one
            await _get(pool)
            assert up.accepted == 4

            now[0] = 301.0
            pool.reap()  # the warm one unused since 0 closes; the one used at 200 stays
            assert await up.ended(3) == ["fin"] * 3
            assert len(pool._idle) == 1

            now[0] = 501.0
            pool.reap()
            assert await up.ended(4) == ["fin"] * 4
            assert pool._idle == []
        finally:
            pool.close()


async def test_without_warm_connections_every_idle_one_closes_after_keepalive() -> None:
    up = Upstream()
    now = [0.0]
    async with raw_server(up.handle) as url:
        pool = h1.Pool(url, limit=8, connect_timeout=5.0, warm=0, clock=lambda: now[0])
        try:
            await asyncio.gather(*(_get(pool) for _ in range(3)))
            now[0] = 30.0
            pool.reap()
            assert await up.ended(3) == ["fin"] * 3
            await _get(pool)  # and the next request opens a new one
            assert up.accepted == 4
        finally:
            pool.close()


async def test_the_reaper_runs_by_itself() -> None:
    """Before the reaper, an idle connection was closed only when a later request took it
    from the pool: after a burst, its connections stayed open for good."""
    up = Upstream()
    async with raw_server(up.handle) as url:
        pool = h1.Pool(url, limit=8, connect_timeout=5.0, keepalive_s=0.05, warm=0)
        try:
            await asyncio.gather(*(_get(pool) for _ in range(3)))
            assert await up.ended(3) == ["fin"] * 3  # (within 5 s: the timer, every 25 ms)
            assert pool._idle == [] and pool._reaper is None  # nothing idle: no timer
        finally:
            pool.close()


def test_an_upstreams_settings_reach_its_pool() -> None:
    settings = UpstreamSettings(
        name="u",
        url="http://127.0.0.1:1/v1",
        keepalive_seconds=5,
        warm_connections=1,
        warm_seconds=60,
    )
    pool = HttpUpstream(settings).pool
    assert (pool.keepalive_s, pool.warm, pool.warm_s) == (5, 1, 60)
