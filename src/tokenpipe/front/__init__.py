"""The fronts: the wire toward clients.

`server` is the HTTP/1.1 server (on httptools) and `wire` its request and answer objects;
`http` serves the API routes on it (request id, auth, body bounds,
validation, then `pipeline.Gateway.open`), frames a stream as SSE (`sse_out`) and answers
errors in the contract's shape; `grpc` serves the bidirectional `ChatStream` with per-request
flow control; `drain`, `cors` and `pacing` are the edges around them.

Layer: the top of the request path. May import `pipeline` and everything below it; nothing
below imports a front.
"""
