"""When a pooled upstream connection may carry another request (upstream/h1.py).

An upstream may close a keep-alive connection at any moment, also right after a complete
answer; a request written in that instant is lost. Two defences, as urllib3 and browsers use:

- Before reuse, a connection is checked for a close (`reusable`): the peer's FIN already seen
  by the protocol, a closing transport, or a readable idle socket (the FIN, or bytes nobody
  asked for, not yet read by the loop: either way the connection is done).
- A request that failed on a reused connection before any byte of its answer arrived is sent
  again once, on a fresh connection (`resendable`): the upstream closed without reading it, so
  it was not processed. Never twice, never after a byte of the answer.
"""

from __future__ import annotations

import asyncio
import select
from typing import Protocol


class _Conn(Protocol):
    lost: bool
    peer_closed: bool
    idle_since: float
    poller: select.poll | None
    uses: int
    answered: bool
    transport: asyncio.Transport | None


def reusable(conn: _Conn, now: float, keepalive_s: float) -> bool:
    """Whether an idle connection can carry the next request (`now`: time.monotonic())."""
    if conn.lost or conn.peer_closed or now - conn.idle_since >= keepalive_s:
        return False
    transport = conn.transport
    if transport is None or transport.is_closing():
        return False
    # Readable now (without reading it): one poll(2), no wait, on the connection's own poll
    # object (`watch`). None: TLS, whose records may be pending (not polled).
    return conn.poller is None or not conn.poller.poll(0)


def watch(fd: int) -> select.poll:
    """A poll object for `reusable`'s look at the socket `fd`, made once a connection (a poll
    object and its register each look cost ~1,400 machine instructions more). poll, not
    select: a gateway may have fds above select's limit of 1024."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return poller


def resendable(conn: _Conn) -> bool:
    """Whether a request whose connection closed under it may be sent again: the connection
    had carried an earlier request (a fresh one failing is an answer about the upstream, not
    a race with its keep-alive close) and no byte of this request's answer arrived."""
    return conn.uses > 1 and not conn.answered
