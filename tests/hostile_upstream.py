"""A small scripted hostile upstream for real-socket tests (issue 16).

A real asyncio TCP server on 127.0.0.1 (its own loop in a background thread, so it serves
gateway subprocesses started with `tests/procs.gateway`). Each completion request is answered
with the raw bytes of a `Reply` the test scripts: the head (status line and headers), then each
body piece as its own socket write (so "in one read" and "split across reads" can both be
tested), then a close, or a hang until the server stops. `GET /v1/models` is answered 404.

    with HostileUpstream(sse_reply([chat_chunk("a"), b"data: [DONE]\\n\\n"])) as up:
        with procs.gateway("--upstream", up.url + "/v1") as g: ...
        assert up.requests == 1

Bounds: a request head is read up to 64 KiB and its body up to Content-Length (at most 1 MiB);
more is a broken test, answered by closing the connection.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

MAX_HEAD = 64 * 1024  # bytes of request head read before giving up
MAX_BODY = 1 << 20  # bytes of request body read at most


@dataclass
class Reply:
    """What the upstream writes for one request: `head`, then each of `pieces` as one write
    (the pieces are sent as they are: the script does its own framing), then closes, or
    holds the connection open until the server stops if `hang`."""

    head: bytes
    pieces: list[bytes] = field(default_factory=list)
    hang: bool = False


def chat_chunk(text: str, finish: str | None = None) -> bytes:
    """One chat.completion.chunk SSE event with `text` as its content delta."""
    obj = {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "sim-model",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def text_chunk(text: str, finish: str | None = None) -> bytes:
    """One text_completion SSE event (the legacy /v1/completions shape)."""
    obj = {
        "id": "x",
        "object": "text_completion",
        "created": 0,
        "model": "sim-model",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def http_chunk(data: bytes) -> bytes:
    """`data` as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse_reply(
    writes: list[bytes], chunked: bool = True, hang: bool = False, status: bytes = b"200 OK"
) -> Reply:
    """An SSE answer whose body is `writes`, each one socket write (and, if `chunked`, one
    HTTP chunk; else the body ends at the close). Unless it hangs, a chunked body ends with
    the last chunk."""
    head = b"HTTP/1.1 " + status + b"\r\nContent-Type: text/event-stream\r\n"
    if chunked:
        head += b"Transfer-Encoding: chunked\r\n\r\n"
        pieces = [http_chunk(w) for w in writes] + ([] if hang else [b"0\r\n\r\n"])
    else:
        head += b"Connection: close\r\n\r\n"
        pieces = list(writes)
    return Reply(head, pieces, hang)


def json_reply(body: bytes, status: bytes = b"200 OK") -> Reply:
    """A unary answer with `body` as sent (Content-Length framed)."""
    head = (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    return Reply(head, [body])


Script = Reply | Callable[[dict[str, Any]], Reply]


class HostileUpstream:
    """The server. `script` is a Reply for every request, or a function of the request's JSON
    body returning one. `requests` counts completion requests (not /v1/models)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()

    def __enter__(self) -> HostileUpstream:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("hostile upstream did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        stop = self._stop
        if stop is not None:
            self._loop.call_soon_threadsafe(stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        conns: set[asyncio.StreamWriter] = set()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conns.add(writer)
            try:
                await self._connection(reader, writer)
            except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                pass
            finally:
                conns.discard(writer)
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=MAX_HEAD)
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()
        await self._stop.wait()
        server.close()
        for w in list(conns):
            w.close()
        await asyncio.sleep(0)  # the handlers see their connections close

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._stop is not None
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            target = lines[0].split(" ")[1] if " " in lines[0] else ""
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = min(int(value.strip()), MAX_BODY)
            body = await reader.readexactly(length) if length else b""
            if target.endswith("/models"):
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                continue
            self.requests += 1
            try:
                req = orjson.loads(body) if body else {}
            except orjson.JSONDecodeError:
                req = {}
            reply = self.script if isinstance(self.script, Reply) else self.script(req)
            writer.write(reply.head)
            await writer.drain()
            for piece in reply.pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.005)  # each piece its own TCP segment and read
            if reply.hang:
                await self._stop.wait()
            return  # one answer per connection: the script's framing may be broken
