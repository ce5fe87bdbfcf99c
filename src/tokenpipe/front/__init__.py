"""The fronts: the wire toward clients.

`http` serves the OpenAI-compatible routes over aiohttp (request id, auth, body bounds,
validation, then `pipeline.Gateway.open`), frames a stream as SSE (`sse_out`) and answers
errors in the contract's shape; `grpc` serves the bidirectional `ChatStream` with per-request
flow control; `drain`, `cors` and `pacing` are the edges around them.

Layer: the top of the request path. May import `pipeline` and everything below it; nothing
below imports a front.
"""
