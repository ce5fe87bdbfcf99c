"""The errors of the wire toward upstreams: what upstream/ raises, and all that the code above
it catches of the wire (as httpx maps httpcore's errors at one boundary). Nothing above
upstream/ needs to know which library speaks HTTP/1.1.

    UpstreamError
    ├── UpstreamUnreachable    no connection (refused, DNS, TLS, any OS error while connecting)
    ├── UpstreamTimeout        a bound passed (connect, head, body read); a TimeoutError too
    ├── UpstreamDisconnected   the connection closed or broke before the response ended
    └── UpstreamProtocolError  the bytes are not HTTP/1.1 as asked for

`HttpUpstream.post()` turns them into `GatewayError`s (502/504); a streamed body's reader (the
relay, the tail's first-token race) sees them as they come and reports them to the client.
"""

from __future__ import annotations


class UpstreamError(Exception):
    """Anything that went wrong on the connection to an upstream (not an answer it sent: a 5xx
    is a response, not an error)."""


class UpstreamUnreachable(UpstreamError):
    """No connection could be made: refused, no address (DNS), the TLS handshake failed, or
    another OS error while connecting; no byte of the request was sent. `post()` makes it a
    502 `upstream_unavailable`; the tail counts it against the upstream's health and retries
    or falls back within its budget."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """A bound the client enforces passed: connecting (`connect_timeout_seconds`), the wait
    for the response head or a body read of a request sent with a timeout. A TimeoutError
    too, so that every wait above that catches TimeoutError treats it as it treats its own
    deadlines (`post()`: 504 `upstream_timeout`; the tail: an attempt that took too long)."""


class UpstreamDisconnected(UpstreamError):
    """The connection closed or broke before the response ended: before its head (closed at
    accept, or a keep-alive close that raced with the request: the pool sends the request
    again once if no byte of the answer came, upstream/reuse.py), or in the middle of its
    body (after the bytes that came before the break), or the pool closed under it. Not
    deterministic, so retried: before the head `post()` makes it a 502
    `upstream_unavailable`, mid-stream the relay reports `upstream_stream_truncated` (or the
    tail continues the stream elsewhere)."""


class UpstreamProtocolError(UpstreamError):
    """The upstream's bytes are not HTTP/1.1 as asked for: a bad status line, header or chunk
    framing, or a protocol switch (101) nobody asked for. Deterministic: asking again gets the
    same, so the gateway reports it (502 upstream_protocol_error) and does not retry it."""
