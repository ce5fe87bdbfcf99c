"""A lean HTTP/1.1 client for the requests the gateway sends upstream: a pool of keep-alive
connections, each request one write, the response parsed by llhttp (httptools) straight into
the response object, and each piece of a streamed body offered to a callback as it is parsed.

Why not aiohttp's ClientSession: it builds a request object, merges header dicts, runs its
trace, cookie, proxy and redirect machinery and a payload writer for every request. That was
the largest single cost of a gateway request (profiled: ~15% of the gateway's CPU per request,
more than all of its own features), and every request is paid for again by every request
queued behind it in a burst. The gateway needs one request shape only: a POST (or a GET of
/models) of a body it already holds, to a URL from its config, with headers from its config.

The pieces: `Pool` (here) hands out `Connection`s (upstream/connection.py), whose answers are
`UpstreamResponse`s (upstream/response.py). The response offers what the gateway reads
(`status`, `headers`, `readany()`, `iter_any()`, `read()`, `close()`); the errors are our own
(upstream/errors.py), so nothing above upstream/ depends on the wire library.

Bounds: at most `limit` connections per upstream (a request beyond waits for one to be
released); idle connections are closed after `keepalive_s`, but for the `warm` most
recently used, kept up to `warm_s` (`reap`, run every `keepalive_s / 2`); a response buffers at most
`HIGH_WATER` bytes (upstream/response.py) before the socket stops being read (TCP
backpressure on the upstream); the host's addresses are looked up once per 10 s for all
its connections (upstream/resolve.py).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import ssl
import time
from collections.abc import Callable

from yarl import URL

from tokenpipe.clock import Timeout
from tokenpipe.upstream.connection import MAX_HEAD_BYTES, Connection
from tokenpipe.upstream.errors import (
    UpstreamDisconnected,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from tokenpipe.upstream.resolve import Resolver, is_private
from tokenpipe.upstream.response import READ_MAX, UpstreamResponse
from tokenpipe.upstream.reuse import resendable, reusable

# Re-exported: the client's surface (and the bounds tests check) is importable from here.
__all__ = [
    "MAX_HEAD_BYTES",
    "READ_MAX",
    "Connection",
    "Pool",
    "UpstreamProtocolError",
    "UpstreamResponse",
]


class Pool:
    """Keep-alive connections to one origin, at most `limit` at a time."""

    def __init__(
        self,
        url: URL,
        *,
        limit: int,
        connect_timeout: float,
        receive_buffer_bytes: int = 0,
        keepalive_s: float = 30.0,
        warm: int = 2,
        warm_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"upstream URL must be http(s)://host[:port]/...: {url}")
        self.host = url.host
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if url.scheme == "https" else None
        )
        self.host_header = url.host_port_subcomponent  # [v6]:port; no default port
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.receive_buffer_bytes = receive_buffer_bytes
        # Idle connections: all but the `warm` most recently used are closed after
        # `keepalive_s`; those `warm` after `warm_s`, so that a request after a quiet spell
        # finds one (a new one costs a TCP and a TLS handshake: 2-3 round trips to the
        # upstream; on loopback 1.1 ms, benchmarks/after_idle.py).
        self.keepalive_s = keepalive_s
        self.warm = warm
        self.warm_s = max(warm_s, keepalive_s)
        self._longest = self.warm_s if warm else keepalive_s  # the bound checked at reuse
        self._now = clock
        self._reaper: asyncio.TimerHandle | None = None  # armed while any is idle
        # Oldest first; taken from the end (LIFO: the most recently used is the warmest).
        # Bound: `limit`.
        self._idle: list[Connection] = []
        self._open = 0  # connections open or opening; bound: `limit`
        # Requests waiting for a connection, in arrival order; bound: the requests in flight
        # (admission's bound). A waiter cancelled in the queue stays there, cancelled, and is
        # skipped when reached (removing it was O(waiters): 1.0 s for 10,000 given up
        # newest first, benchmarks/hostile_cost.py); once they are half the queue it is rebuilt
        # without them, so it holds at most twice the live waiters (amortised O(1) each).
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._cancelled = 0  # cancelled waiters counted since the last rebuild
        self._members: set[Connection] = set()
        self.resent = 0  # requests sent again after a reused connection closed under them
        # The host's addresses, looked up once for every connection (upstream/resolve.py).
        self.resolver = Resolver(self.host, self.port)
        #: The last connection's peer is on this machine or a private network (loopback,
        #: RFC 1918, link-local, IPv6 unique local): a self-hosted engine, not a provider.
        self.private = False

    async def request(self, head: bytes, body: bytes, timeout: float | None) -> UpstreamResponse:
        """Sends `head` (the request line and headers, ending in a blank line) and `body` in
        one write; returns once the response head arrived (within `timeout` seconds if set).
        A task cancelled while it waits closes the connection. A request that failed on a
        reused connection before any byte of its answer is sent once more, on a fresh one
        (upstream/reuse.py; `resent` counts them)."""
        conn = await self._acquire()
        try:
            return await self._exchange(conn, head, body, timeout)
        except UpstreamDisconnected:
            if not resendable(conn):
                raise
        self.resent += 1
        return await self._exchange(await self._acquire(fresh=True), head, body, timeout)

    async def _exchange(
        self, conn: Connection, head: bytes, body: bytes, timeout: float | None
    ) -> UpstreamResponse:
        try:
            head_future = conn.send(head + body if len(body) < 65536 else head, timeout)
            if len(body) >= 65536:
                assert conn.transport is not None
                conn.transport.write(body)  # no copy of a large body
            if timeout is None:
                return await head_future
            try:
                with Timeout(timeout):
                    return await head_future
            except TimeoutError:  # only this bound's own (an outer one cancels)
                raise UpstreamTimeout(f"no answer from the upstream in {timeout:g} s") from None
        except BaseException:
            conn.abort()
            raise

    async def _acquire(self, fresh: bool = False) -> Connection:
        """An idle connection that passes the check before reuse, else a new one once there
        is room; `fresh`: always a new one (an idle one is closed if that makes the room)."""
        now = self._now()
        while True:
            while self._idle and not fresh:
                conn = self._idle.pop()
                if reusable(conn, now, self._longest):
                    return conn
                conn.abort()
            if fresh and self._open >= self.limit and self._idle:
                self._idle.pop(0).abort()  # the coldest one
                continue
            if self._open < self.limit:
                break
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then cancelled: the turn passes on
                else:
                    self._drop(waiter)
                raise
        self._open += 1
        try:
            return await self._connect()
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                infos = await self.resolver.addresses()
                error: OSError | None = None
                for family, _, proto, _, addr in infos:
                    # The event loop connects the address itself (uvloop: in C, one await).
                    # A socket of our own through `sock_connect`, then `create_connection
                    # (sock=)`, took 27 system calls a connection against 15, and 79 us of
                    # CPU against 47 (benchmarks/connect.py, 1,000 at once): a cold burst pays
                    # it once per stream. The address is the resolver's IP literal, which the
                    # loop does not look up again.
                    try:
                        _, conn = await loop.create_connection(
                            functools.partial(Connection, self, self.receive_buffer_bytes),
                            addr[0],
                            addr[1],
                            family=family,
                            proto=proto,
                            ssl=self.ssl,
                            server_hostname=self.host if self.ssl else None,
                        )
                    except ssl.SSLError:
                        raise  # the upstream's TLS: another address would not change it
                    except OSError as e:
                        error = e
                        continue
                    if conn.lost:  # closed by the upstream as soon as accepted
                        raise UpstreamDisconnected("the upstream closed the connection at once")
                    self._members.add(conn)
                    self.private = is_private(addr[0])
                    return conn
                self.resolver.forget()  # none of them took it: look again next time
                try:
                    raise error or OSError(f"no address for {self.host}")
                finally:
                    # Its traceback holds this frame: kept in `error`, the exception and
                    # the frame were a cycle, freed only by the collector (each refused
                    # connect: tests/test_request_garbage.py).
                    error = None
        except TimeoutError:  # (an OSError too: before the clause below)
            raise UpstreamTimeout(f"connecting to {self.host_header} timed out") from None
        except OSError as e:  # refused, DNS (gaierror), TLS (SSLError), ...
            raise UpstreamUnreachable(f"cannot connect to {self.host_header}: {e}") from None

    def put_back(self, conn: Connection) -> None:
        conn.idle_since = self._now()
        self._idle.append(conn)
        if self._reaper is None:
            self._arm()
        self._wake_one()

    def _arm(self) -> None:
        # Every keepalive_s / 2 while any connection is idle: one is closed at most half
        # its keep-alive late, for one timer per 15 s (by default) under load.
        loop = asyncio.get_running_loop()
        self._reaper = loop.call_later(self.keepalive_s / 2, self._reap_now)

    def _reap_now(self) -> None:
        self._reaper = None
        self.reap()
        if self._idle:
            self._arm()

    def reap(self) -> None:
        """Closes the idle connections past their keep-alive (see `__init__`) and drops
        those the upstream closed. The warm ones kept past `keepalive_s` get TCP keep-alive
        probes (`Connection.keep_warm`)."""
        now = self._now()
        live = []
        for conn in self._idle:
            if reusable(conn, now, math.inf):
                live.append(conn)
            else:
                conn.abort()  # closed by the upstream, or it sent what nobody asked for
        kept = []
        warm_from = len(live) - self.warm
        for i, conn in enumerate(live):
            idle_s = now - conn.idle_since
            if idle_s < self.keepalive_s:
                kept.append(conn)
            elif i >= warm_from and idle_s < self.warm_s:
                conn.keep_warm()
                kept.append(conn)
            else:
                conn.close()
        self._idle = kept

    def forget(self, conn: Connection) -> None:
        """A connection closed: its place is free."""
        if conn in self._members:
            self._members.discard(conn)
            self._open -= 1
            self._wake_one()

    def _drop(self, waiter: asyncio.Future[None]) -> None:
        """A waiter given up on: cancelled where it stands (`_wake_one` skips it)."""
        waiter.cancel()
        self._cancelled += 1
        if self._cancelled * 2 > len(self._waiters):
            self._waiters = collections.deque(w for w in self._waiters if not w.done())
            self._cancelled = 0

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for conn in list(self._members):
            conn.abort()
        self._idle.clear()
