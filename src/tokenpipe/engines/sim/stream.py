"""The sim's streamed answer: SSE chunks on an exact schedule, with stream faults applied.

Timing is an absolute schedule from the moment the request is read: the role chunk at 0, the
first content chunk at ttft, chunk j at ttft + j * tokens_per_chunk * itl. Sleeping to absolute
due times keeps errors from adding up; with zero delays every due time has passed, so events go
out in large writes and the sim sustains far more than 10,000 tokens/s on one core.
`start` and `paced` (the schedule and the stream faults) are the one loop: `stream_events`
writes any API's `Frames` with them (chat and completions here, Responses in responses.py),
and Anthropic's Messages stream (messages.py) uses them directly.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable
from typing import Protocol

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
#: How the arguments of a forced tool call start: `{"words":"<the words>"}`.
ARGS_OPEN = '{"words":"'
#: Longest a `hang-after-headers` fault holds a connection (seconds).
MAX_HANG = 600.0
#: What a `garbage` fault sends right after the opening: an event that is not JSON.
GARBAGE = b"data: this is not json\n\n"


class Frames(Protocol):
    """The bytes of one API's stream: what opens it, each content delta, what closes it."""

    def opening(self) -> bytes: ...

    def delta(self, text: str) -> bytes: ...

    def closing(self) -> bytes: ...


class _ChatFrames:
    """Chat or text completion chunks, `[DONE]` last."""

    def __init__(
        self,
        rec: Record,
        kind: str,
        model: str,
        finish_reason: str,
        usage: dict[str, int] | None,
        call: str | None = None,
    ) -> None:
        self.kind = kind
        self.finish_reason = finish_reason
        self.usage = usage
        #: A forced tool call (chat only): the function's name; its id; whether it started.
        self.call = call
        self.call_id = "call_" + rec.id
        self.called = False
        created = str(int(time.time())).encode()
        self.usage_field = b',"usage":null' if usage is not None else b""
        if kind == "chat":
            self.head = (
                b'{"id":"chatcmpl-' + rec.id.encode() + b'","object":"chat.completion.chunk",'
                b'"created":'
                + created
                + b',"model":'
                + orjson.dumps(model)
                + b',"system_fingerprint":"tokenpipe-sim","choices":[{"index":0,'
            )
            self.pre = b"data: " + self.head + b'"delta":{"content":'
            self.post = b'},"logprobs":null,"finish_reason":null}]' + self.usage_field + b"}\n\n"
        else:
            self.head = (
                b'{"id":"cmpl-' + rec.id.encode() + b'","object":"text_completion",'
                b'"created":'
                + created
                + b',"model":'
                + orjson.dumps(model)
                + b',"system_fingerprint":"tokenpipe-sim","choices":[{"index":0,'
            )
            self.pre = b"data: " + self.head + b'"text":'
            self.post = b',"logprobs":null,"finish_reason":null}]' + self.usage_field + b"}\n\n"

    def opening(self) -> bytes:
        if self.kind != "chat":
            return b""
        return sse.encode(
            self.head + b'"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]' + self.usage_field + b"}"
        )

    def delta(self, text: str) -> bytes:
        if self.call is not None:
            return self._arguments(text)
        return self.pre + orjson.dumps(text) + self.post

    def _arguments(self, text: str) -> bytes:
        """A tool call chunk: the first names the function, the rest add to its arguments."""
        call: dict[str, object] = {"index": 0, "function": {"arguments": text}}
        if not self.called:
            self.called = True
            function = {"name": self.call, "arguments": ARGS_OPEN + text.lstrip()}
            call = {"index": 0, "id": self.call_id, "type": "function", "function": function}
        delta = orjson.dumps({"tool_calls": [call]})
        tail = b',"logprobs":null,"finish_reason":null}]' + self.usage_field + b"}\n\n"
        return b"data: " + self.head + b'"delta":' + delta + tail

    def closing(self) -> bytes:
        end_delta = b'"delta":{},' if self.kind == "chat" else b'"text":"",'
        out = [self._arguments('"}')] if self.call is not None else []
        out += [
            sse.encode(
                self.head
                + end_delta
                + b'"logprobs":null,"finish_reason":"'
                + self.finish_reason.encode()
                + b'"}]'
                + self.usage_field
                + b"}"
            )
        ]
        if self.usage is not None:
            tail = self.head.rsplit(b'"choices":', 1)[0]
            out.append(
                sse.encode(tail + b'"choices":[],"usage":' + orjson.dumps(self.usage) + b"}")
            )
        out.append(sse.DONE_EVENT)
        return b"".join(out)


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
    call: str | None = None,
) -> web.StreamResponse:
    """Streams `tokens` as chat or text completion chunks (see `stream_events`); `call`: the
    function a forced tool call names (its arguments hold the words)."""
    frames = _ChatFrames(rec, kind, model, finish_reason, usage, call)
    return await stream_events(request, rec, frames, tokens, timing, headers, finish)


async def stream_events(
    request: web.Request,
    rec: Record,
    frames: Frames,
    tokens: list[str],
    timing: Timing,
    headers: dict[str, str],
    finish: Callable[[Record, str], None],
) -> web.StreamResponse:
    """Streams `tokens` as `frames` writes them, on the request's schedule, with its stream
    fault applied; `finish(rec, outcome)` records how the stream ended (completed, reset or
    truncated)."""
    t0 = asyncio.get_running_loop().time()
    resp, hung = await start(request, rec, timing, headers, finish)
    if hung:
        return resp
    buf: list[bytes] = [frames.opening()]
    if timing.fault is not None and timing.fault.kind == "garbage":
        buf.append(GARBAGE)
    await resp.write(b"".join(buf))
    buf.clear()

    def encode(first: int, stop: int) -> bytes:
        return frames.delta("".join(tokens[first:stop]))

    if not await paced(request, resp, rec, len(tokens), timing, t0, encode, buf, finish):
        return resp
    buf.append(frames.closing())
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
