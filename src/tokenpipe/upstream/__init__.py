"""The wire toward upstreams: a keep-alive HTTP/1.1 client written for the relay's hot path.

`http.HttpUpstream` is one configured upstream (its pool, request heads, `/models` cache);
`h1` the connection pool, `connection` the protocol on httptools, `response` the streamed
response the relay reads (and pushes from), `reuse` when a pooled connection may be reused or
a request resent. Every failure leaves as one of this package's own errors (`errors`:
unreachable, timeout, disconnected, protocol), mapped here at the boundary, so nothing above
knows the wire library.

Layer: the bottom of the request path. May import `control` (the pace header), `settings`,
`errors`, `observe`; never relay, router or anything above.
"""
