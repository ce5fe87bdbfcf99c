"""The memory the request bodies being served hold, estimated and bounded.

A body is held, parsed, for as long as its request lasts: while it waits for the limiter
(up to `limits.max_waiting` requests) and while its stream runs. Parsed, JSON costs more than
its bytes, and a client chooses how much more: 4 MiB of text held ~14 MiB, 4 MiB of empty
content parts (`[{},{},...]`, 1.4 M objects, parsed once as sent and once typed) ~200 MiB
(audit of 2026-12-06: 8 such requests took the gateway from 48 to 1,675 MiB). Each body is
charged an estimate of that when it arrives, and the sum is bounded by
`server.max_body_memory_bytes`: past it a new request gets 503 `server_overloaded` with
Retry-After, whatever its key, before any other work. A request alone is never refused (a
bound below one body's estimate would refuse it forever). The charge is given back when the
request's handler ends, its stream included.
"""

from __future__ import annotations

from tokenpipe.errors import GatewayError

#: Bytes a body's byte is charged: the bytes read, their Python text, the JSON re-encoded for
#: the upstream (measured: 4 MiB of text held ~14 MiB).
PER_BYTE = 4
#: Bytes charged for each `{` or `[` in a body: a dict or list parsed (~64 bytes), its typed
#: copy and its place in its parent (measured: ~145 bytes an empty content part). A bracket
#: inside a string is charged as well: an estimate on the high side, never a refusal alone.
PER_CONTAINER = 128
#: Seconds a refused client is asked to wait (Retry-After).
RETRY_AFTER = 1


def estimate(body: bytes) -> int:
    """The bytes `body` holds while its request lasts, estimated (two C scans: ~0.1 ms a
    MiB; nothing for a small body)."""
    return PER_BYTE * len(body) + PER_CONTAINER * (body.count(b"{") + body.count(b"["))


class BodyMemory:
    """What the bodies being served hold, against `limit` bytes."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0  # bytes charged to the requests being served

    def take(self, body: bytes) -> int:
        """Charges `body`; returns its charge, to `give` back. Raises 503 past the limit."""
        cost = estimate(body)
        if self.held and self.held + cost > self.limit:
            raise GatewayError(
                503,
                "The gateway holds as many request bodies as it may: try again shortly.",
                code="server_overloaded",
                retry_after=RETRY_AFTER,
            )
        self.held += cost
        return cost

    def give(self, cost: int) -> None:
        self.held -= cost
