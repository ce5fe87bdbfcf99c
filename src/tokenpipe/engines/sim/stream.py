"""The sim's streamed answer: SSE chunks on an exact schedule, with stream faults applied.

Timing is an absolute schedule from the moment the request is read: the role chunk at 0, the
first content chunk at ttft, chunk j at ttft + j * tokens_per_chunk * itl. Sleeping to absolute
due times keeps errors from adding up; with zero delays every due time has passed, so events go
out in large writes and the sim sustains far more than 10,000 tokens/s on one core.
`start` and `paced` (the schedule and the stream faults) serve Anthropic's Messages stream
too (messages.py); `stream_completion` writes OpenAI's chunks.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable

import orjson
from aiohttp import web

from tokenpipe import sse
from tokenpipe.engines.sim.config import Timing
from tokenpipe.engines.sim.records import Record

#: Bytes gathered before a write when events are due faster than they can be written.
WRITE_BATCH = 64 * 1024
#: Kernel send buffer of a streaming connection (bytes; Linux doubles it). Like a server
#: across a real network, the sim holds a bounded amount in flight: a reader that stops
#: reading stops the stream within this many bytes, whatever the machine's tcp_wmem allows.
SEND_BUFFER_BYTES = 256 * 1024
#: Longest a `hang-after-headers` fault holds a connection (seconds).
MAX_HANG = 600.0
#: What a `garbage` fault sends right after the headers: an event that is not JSON.
GARBAGE = b"data: this is not json\n\n"


async def stream_completion(
    request: web.Request,
    rec: Record,
    kind: str,
    model: str,
    tokens: list[str],
    timing: Timing,
    finish_reason: str,
    usage: dict[str, int] | None,
    headers: dict[str, str],
    finish: Callable[[Record, str], None],
) -> web.StreamResponse:
    """Streams `tokens` as chat or text completion chunks; `finish(rec, outcome)` records how
    the stream ended (completed, reset or truncated)."""
    t0 = asyncio.get_running_loop().time()
    resp, hung = await start(request, rec, timing, headers, finish)
    if hung:
        return resp
    created = int(time.time())
    usage_field = b',"usage":null' if usage is not None else b""
    if kind == "chat":
        head = (
            b'{"id":"chatcmpl-' + rec.id.encode() + b'","object":"chat.completion.chunk",'
            b'"created":'
            + str(created).encode()
            + b',"model":'
            + orjson.dumps(model)
            + b',"system_fingerprint":"tokenpipe-sim","choices":[{"index":0,'
        )
        content_pre = b'"delta":{"content":'
        content_post = b'},"logprobs":null,"finish_reason":null}]' + usage_field + b"}"
    else:
        head = (
            b'{"id":"cmpl-' + rec.id.encode() + b'","object":"text_completion",'
            b'"created":'
            + str(created).encode()
            + b',"model":'
            + orjson.dumps(model)
            + b',"system_fingerprint":"tokenpipe-sim","choices":[{"index":0,'
        )
        content_pre = b'"text":'
        content_post = b',"logprobs":null,"finish_reason":null}]' + usage_field + b"}"

    buf: list[bytes] = []
    if kind == "chat":
        buf.append(
            sse.encode(
                head + b'"delta":{"role":"assistant","content":""},'
                b'"logprobs":null,"finish_reason":null}]' + usage_field + b"}"
            )
        )
    if timing.fault is not None and timing.fault.kind == "garbage":
        buf.append(GARBAGE)
    await resp.write(b"".join(buf))
    buf.clear()

    def encode(start: int, stop: int) -> bytes:
        text = "".join(tokens[start:stop])
        return b"data: " + head + content_pre + orjson.dumps(text) + content_post + b"\n\n"

    if not await paced(request, resp, rec, len(tokens), timing, t0, encode, buf, finish):
        return resp
    end_delta = b'"delta":{},' if kind == "chat" else b'"text":"",'
    buf.append(
        sse.encode(
            head
            + end_delta
            + b'"logprobs":null,"finish_reason":"'
            + finish_reason.encode()
            + b'"}]'
            + usage_field
            + b"}"
        )
    )
    if usage is not None:
        tail = head.rsplit(b'"choices":', 1)[0]
        buf.append(sse.encode(tail + b'"choices":[],"usage":' + orjson.dumps(usage) + b"}"))
    buf.append(sse.DONE_EVENT)
    await resp.write(b"".join(buf))
    await resp.write_eof()
    finish(rec, "completed")
    return resp


async def start(
    request: web.Request,
    rec: Record,
    timing: Timing,
    headers: dict[str, str],
    finish: Callable[[Record, str], None],
) -> tuple[web.StreamResponse, bool]:
    """The stream's response, prepared (headers sent). True: a `hang-after-headers` fault
    held it until the client left or MAX_HANG passed; nothing more is to be sent."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    await resp.prepare(request)
    if timing.fault is not None and timing.fault.kind == "hang-after-headers":
        await asyncio.sleep(MAX_HANG)
        finish(rec, "completed")
        return resp, True
    return resp, False


async def paced(
    request: web.Request,
    resp: web.StreamResponse,
    rec: Record,
    n: int,
    timing: Timing,
    t0: float,
    encode: Callable[[int, int], bytes],
    buf: list[bytes],
    finish: Callable[[Record, str], None],
) -> bool:
    """Writes the events of tokens 0..n on the schedule (`encode(start, stop)`: the event(s)
    carrying tokens start..stop), with the stream faults of `timing` applied. True: all were
    sent and the stream goes on (what is left in `buf` is written with its last events);
    False: a reset or truncate fault ended it (recorded with `finish`)."""
    loop = asyncio.get_running_loop()
    fault = timing.fault
    fkind = fault.kind if fault else None
    per = timing.tokens_per_chunk
    gap = per * timing.itl_ms / 1000.0  # seconds between chunks
    due = t0 + timing.ttft_ms / 1000.0
    if fkind == "stall-first":
        due += fault.ms / 1000.0  # type: ignore[union-attr]
    sent = 0
    size = sum(map(len, buf))
    stalled = False
    for start in range(0, n, per):
        if fault is not None and sent >= fault.after and fkind in ("reset", "truncate"):
            if buf:
                await resp.write(b"".join(buf))
            rec.tokens = sent
            if fkind == "reset":
                reset_connection(request)
                finish(rec, "reset")
                return False
            finish(rec, "truncated")
            await resp.write_eof()
            return False
        if fkind == "stall" and not stalled and sent >= fault.after:  # type: ignore[union-attr]
            stalled = True
            due += fault.ms / 1000.0  # type: ignore[union-attr]
        delay = due - loop.time()
        if delay > 0 or size >= WRITE_BATCH:
            if buf:
                rec.tokens = sent  # written so far, shown by /sim/stats while running
                await resp.write(b"".join(buf))
                buf.clear()
                size = 0
            if delay > 0:
                await asyncio.sleep(delay)
        stop = min(n, start + per)
        ev = encode(start, stop)
        buf.append(ev)
        size += len(ev)
        sent += stop - start
        due += gap
    rec.tokens = sent
    return True


def reset_connection(request: web.Request) -> None:
    """Cuts the connection with a TCP RST, as a `reset` fault asks."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Linger 0: close() sends RST instead of FIN, like a crashed or cut-off server.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
