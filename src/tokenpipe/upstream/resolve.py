"""The addresses of one upstream host, looked up once and shared (upstream/h1.py's Pool).

Why: every new connection used to call `getaddrinfo`, which for a name (not an IP literal)
runs in libuv's thread pool and asks the system resolver; glibc caches nothing without nscd.
A cold burst opens a connection per stream, so 1,000 streams were 1,000 DNS queries at once.
Measured here (benchmarks/resolve.py, pypi.org, this VM's resolver): 10 lookups at once took
3 ms, 100 at once 20 s (the resolver drops queries and glibc asks again after its 5 s
timeout), and of 1,000 at once 150 had answered after 30 s. Now one lookup serves every
connection opened within `TTL` seconds, and the connections that need it while it runs wait
for that same lookup (single flight): 100 at once 3.3 ms, 1,000 at once 25 ms.

Past its TTL an answer still serves while the host is looked up again in the background, so
only the first connection of all waits for a lookup (1-50 ms to a real resolver); before,
the first new connection after every 10 quiet seconds did. A lookup that fails leaves the
answer as it was, and the next new connection asks again; an answer whose addresses all
refuse a connection is dropped (`forget()`), and the next connection waits for a lookup.

Bounds: one cached answer per pool (pools are per configured upstream); at most one lookup in
flight; each waiter's wait is bounded by its caller's connect timeout (the lookup itself by
the system resolver's own timeouts). A failed lookup is not cached.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
from typing import Any

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.flight import SingleFlight

#: Seconds an answer is reused: aiohttp's default (`ttl_dns_cache=10`). An upstream that moves
#: to new addresses is followed within this, or at once when the old ones refuse.
TTL = 10.0

AddrInfo = tuple[Any, ...]  # (family, type, proto, canonname, sockaddr), as getaddrinfo gives


class Resolver:
    def __init__(self, host: str, port: int, *, ttl: float = TTL, clock: Clock = MONOTONIC):
        self.host = host
        self.port = port
        self.ttl = ttl
        self.clock = clock
        self._infos: list[AddrInfo] | None = None
        self._expires = 0.0
        self._lookup: SingleFlight[list[AddrInfo]] = SingleFlight()
        #: Lookups made (each a getaddrinfo call).
        self.lookups = 0

    async def addresses(self) -> list[AddrInfo]:
        """The host's addresses: the cached answer; past its TTL it is looked up again in the
        background and the old answer serves meanwhile (no connection waits for a lookup
        once there is an answer, as with Envoy's DNS cache); with no answer, the lookup in
        flight (started if none is). A waiter that is cancelled leaves the lookup to the
        others."""
        infos = self._infos
        if infos is None:
            return await self._lookup.do(None, self._resolve)
        if self.clock.now() >= self._expires:
            self._lookup.start(None, self._resolve)  # at most one in flight
        return infos

    async def _resolve(self) -> list[AddrInfo]:
        self.lookups += 1
        infos = await asyncio.get_running_loop().getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
        self._infos = list(infos)
        self._expires = self.clock.now() + self.ttl
        return self._infos

    def forget(self) -> None:
        """The cached answer is dropped: the next connection looks the host up again."""
        self._infos = None


@functools.lru_cache(maxsize=64)  # bound: 64 addresses (a pool's answer holds a few)
def is_private(address: str) -> bool:
    """`address` (an IP literal, as the resolver gives) is on this machine or a private
    network: loopback, RFC 1918, link-local, IPv6 unique local, or IPv4 mapped onto those."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # fe80::1%eth0: the zone dropped
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_private or ip.is_loopback or ip.is_link_local
