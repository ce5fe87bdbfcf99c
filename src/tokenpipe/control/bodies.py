"""The memory the requests being served hold, estimated and bounded: one budget for both
fronts (HTTP bodies, gRPC messages).

A body is held, parsed, for as long as its request lasts: while it waits for the limiter
(up to `limits.max_waiting` requests) and while its stream runs. Parsed, JSON costs more than
its bytes, and a client chooses how much more: 4 MiB of text held ~14 MiB, 4 MiB of empty
content parts (`[{},{},...]`, 1.4 M objects, parsed once as sent and once typed) ~200 MiB
(audit of 2026-12-06: 8 such requests took the gateway from 48 to 1,675 MiB). Each body is
charged an estimate of that when it arrives, and the sum is bounded by
`server.max_body_memory_bytes`: past it a new request gets 503 `server_overloaded` with
Retry-After, whatever its key, before any other work. A request alone is never refused (a
bound below one body's estimate would refuse it forever). The charge is given back when the
request's handler ends, its stream included. A gRPC ChatRequest is charged by its size and
its messages (`estimate_messages`): each one becomes a dict and a typed struct, and 4 MiB of
empty messages is 2 M of them.
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
#: Bytes charged for each message of a gRPC ChatRequest: its dict (two keys), its strings,
#: its typed copy and its places in two lists (~270 bytes for an empty message).
PER_MESSAGE = 256
#: Seconds a refused client is asked to wait (Retry-After).
RETRY_AFTER = 1


def estimate(body: bytes) -> int:
    """The bytes `body` holds while its request lasts, estimated (two C scans: ~0.1 ms a
    MiB; nothing for a small body)."""
    return PER_BYTE * len(body) + PER_CONTAINER * (body.count(b"{") + body.count(b"["))


def estimate_messages(size: int, messages: int) -> int:
    """The bytes a gRPC ChatRequest of `size` bytes with `messages` messages holds."""
    return PER_BYTE * size + PER_MESSAGE * messages


class BodyMemory:
    """What the bodies being served hold, against `limit` bytes."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0  # bytes charged to the requests being served

    def take(self, cost: int) -> int:
        """Charges `cost` bytes (`estimate`); returns it, to `give` back. Raises 503 past the
        limit."""
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
