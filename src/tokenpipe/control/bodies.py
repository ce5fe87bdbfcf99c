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

Parsed, a body also costs the event loop's time, and again a client chooses how much: 4 MiB
of text parses in 7 ms, 4 MiB of `[]` in ~110 ms (benchmarks/hostile_cost.py --case body).
`ParseTime` bounds the share of the loop each key's bodies take to parse, estimated from the
same count of brackets: past it, a key's bodies of many containers get 429 before they are
parsed, and other keys' requests are not held up behind them.
"""

from __future__ import annotations

from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control.bucket import TokenBucket
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics

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


#: Seconds of the event loop a `{` or `[` of a body costs to parse: orjson building it,
#: msgspec checking it (the collector paused: dialects/openai_schema.py), freeing it after
#: (hostile_cost.py --case body, 4 MiB: 1.4 M `[]` 109 ms, 1.4 M `{}` parts 123 ms). Text
#: is not charged: it parses at ~1.7 ns a byte whatever it holds (4 MiB: 7 ms).
PARSE_PER_CONTAINER = 85e-9
#: Bodies with fewer containers than this are neither charged nor refused for their parse:
#: under ~1 ms of it whatever else they hold (a request with large tool schemas has a few
#: hundred; text, none).
PARSE_FREE_CONTAINERS = 10_000
#: Seconds of parse a key may use at once, before its share applies: about four of the
#: costliest 4 MiB bodies in a row.
PARSE_BURST_SECONDS = 0.5


#: Bodies from this size have their brackets found one by one before they are counted.
#: bytes.count of one byte is a plain loop (~0.3 ns a byte: two of them took 49 us for 64
#: KiB, 2.6 times orjson's parse of as much text); bytes.find is memchr (~0.01 ns a byte,
#: ~0.1 us a call). Text holds few brackets; a smaller body is counted at once (< 2.5 us).
FIND_FROM_BYTES = 4096
#: Brackets of one kind found one by one; past them, the rest of the body is counted (a
#: body of many containers: at most ~6 us more than counting it at once).
FIND_AT_MOST = 32


def containers(body: bytes) -> int:
    """The JSON objects and arrays in `body`, counted by its brackets (64 KiB of text: ~2 us).
    A bracket inside a string counts too: every figure drawn from it is on the high side."""
    if len(body) < FIND_FROM_BYTES:
        return body.count(b"{") + body.count(b"[")
    return _brackets(body, b"{") + _brackets(body, b"[")


def _brackets(body: bytes, bracket: bytes) -> int:
    find = body.find
    n = 0
    at = find(bracket)
    while at >= 0:
        n += 1
        if n == FIND_AT_MOST:  # many: the rest, from this one on, counted by one scan
            return n - 1 + body.count(bracket, at)
        at = find(bracket, at + 1)
    return n


def estimate(body: bytes, count: int | None = None) -> int:
    """The bytes `body` holds while its request lasts, estimated; `count`: its `containers`,
    when they are counted already."""
    return PER_BYTE * len(body) + PER_CONTAINER * (containers(body) if count is None else count)


def parse_seconds(count: int) -> float:
    """The event loop's time the containers of a body (`count`) take to parse, estimated."""
    return PARSE_PER_CONTAINER * count


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


class ParseTime:
    """The event loop's time each key's bodies take to parse, bounded: a key's bodies may use
    `share` of it (seconds of parse per second), after a burst of PARSE_BURST_SECONDS. A body
    of PARSE_FREE_CONTAINERS or more is charged its estimated parse time before it is
    parsed; past the key's share it gets 429 `rate_limit_exceeded` with Retry-After, and
    nothing of it is parsed. A body costlier than the burst alone is served once the budget
    is full, leaving it in debt (control/bucket.py's reservation, at most two bursts deep).

    Without auth every client is the key `anonymous` (as for quotas): one client's costly
    bodies can then hold up another's, never its others.

    Bound: a bucket a key name, and the names are the configured keys (and `anonymous`).
    """

    __slots__ = ("_buckets", "clock", "share")

    def __init__(self, share: float, clock: Clock = MONOTONIC) -> None:
        self.share = share
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def charge(self, key: str, seconds: float) -> None:
        """Charges `seconds` of parse to `key`, or raises 429 when its share is spent."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = TokenBucket(self.share, PARSE_BURST_SECONDS, self.clock)
            self._buckets[key] = bucket
        wait = bucket.reserve(seconds)
        if wait > 0:
            metrics.ADMISSION_REJECTED.labels("parse").inc()
            raise GatewayError(
                429,
                "This API key's request bodies are taking too much of the gateway's time to "
                f"parse. Please try again in {wait:.2g} s.",
                code="rate_limit_exceeded",
                retry_after=wait,
            )
