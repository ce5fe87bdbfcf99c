"""The relay: moves one upstream stream to one client, with bounded memory, and measures it.

Two parts per stream (`stream.relay_stream`): the reader parses upstream SSE events into pieces
(`events.EventParser`, asking the request's dialect what each event is) and writes them to the
client itself while it keeps up, else queues them in the one bounded buffer
(`buffer.Accumulator`), merging neighbouring content deltas; the writer sends what queued as
the client and its flow gate allow. The reader runs in the request's own task; the writer's
task starts only once something queues (a client that keeps up never needs one). Which reader
runs is the caller's: the router passes one that races for the first token, watches for stalls
(`stall.StallWatch`) and continues a cut stream.

Layer: below router, above upstream. May import `dialects`, `upstream` (its response type and
errors), `control/flowgate`, `observe`, `sse`, `errors`, `usage`; never router, pipeline or
front.
"""
