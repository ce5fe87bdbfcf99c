"""A minimal raw SSE reader over aiohttp for tests that need every byte and chunk."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from tokenpipe import sse


@dataclass
class StreamResult:
    status: int
    headers: dict[str, str]
    chunks: list[dict[str, Any]] = field(default_factory=list)
    comments: list[bytes] = field(default_factory=list)
    done: bool = False
    body: bytes = b""

    @property
    def text(self) -> str:
        out = []
        for c in self.chunks:
            for ch in c.get("choices") or ():
                delta = ch.get("delta")
                out.append(
                    (delta or {}).get("content") or ""
                    if delta is not None
                    else ch.get("text") or ""
                )
        return "".join(out)

    @property
    def usage(self) -> dict[str, Any] | None:
        for c in self.chunks:
            if c.get("usage"):
                return c["usage"]
        return None

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [c["error"] for c in self.chunks if "error" in c]


async def post_stream(
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
    on_chunk: Callable[[dict[str, Any]], None] | None = None,
) -> StreamResult:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
        s.post(url, json=body, headers=headers) as resp,
    ):
        result = StreamResult(resp.status, dict(resp.headers))
        if resp.status != 200 or not body.get("stream"):
            result.body = await resp.read()
            return result
        dec = sse.SSEDecoder()
        async for chunk in resp.content.iter_any():
            for ev in dec.feed(chunk):
                if ev.comment:
                    result.comments.append(ev.data)
                elif ev.data == sse.DONE:
                    result.done = True
                else:
                    result.chunks.append(orjson.loads(ev.data))
                    if on_chunk is not None:
                        on_chunk(result.chunks[-1])
        return result


def unchunk(raw: bytes) -> bytes:
    """The body of a raw HTTP/1.1 200 response in chunked transfer encoding, de-chunked."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], head
    data = b""
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        data += body[:size]
        body = body[size + 2 :]
    return data
