"""The one SSE codec (server-sent events, as the OpenAI streaming API uses them).

Written by hand because the libraries (aiohttp-sse, sse-starlette, httpx-sse) are line-at-a-time
and allocate per line; here one `feed()` splits a whole socket read into events with `bytes.find`,
which keeps the per-token cost of the relay to a few operations.
"""

from __future__ import annotations

from typing import NamedTuple

DONE = b"[DONE]"


class Event(NamedTuple):
    data: bytes
    #: True for a comment line (`: text`), which SSE clients ignore; `data` then holds the text.
    comment: bool = False
    #: The `event:` field, if any (OpenAI does not send one; Anthropic does).
    event: str | None = None


class SSEProtocolError(Exception):
    pass


def encode(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def encode_comment(text: bytes) -> bytes:
    return b": " + text + b"\n\n"


DONE_EVENT = encode(DONE)


class SSEDecoder:
    """Incremental decoder. Bound: one event may be at most `max_event_bytes`; a longer one
    raises `SSEProtocolError` (an upstream sending that is broken or hostile)."""

    __slots__ = ("_buf", "max_event_bytes")

    def __init__(self, max_event_bytes: int = 4 * 1024 * 1024) -> None:
        self._buf = b""
        self.max_event_bytes = max_event_bytes

    def feed_one(self, chunk: bytes) -> bytes | None:
        """The data of `chunk` if it is exactly one whole one-line `data:` event with nothing
        buffered before it (what a streaming LLM server sends per read), else None: use
        `feed`. A quarter of `feed`'s cost for the common case."""
        if self._buf or chunk.find(b"\n") != len(chunk) - 2 or chunk[-1:] != b"\n":
            return None
        if chunk[:6] != b"data: ":
            return None
        return chunk[6:-2]

    def feed(self, chunk: bytes) -> list[Event]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        blocks = buf.split(b"\n\n")
        rest = blocks.pop()  # after the last blank line: an unterminated event, often b""
        events: list[Event] = []
        for block in blocks:
            # Fast path: the one-line `data: {...}` that OpenAI-compatible servers send.
            if block[:6] == b"data: " and b"\n" not in block:
                events.append(Event(block[6:]))
            elif block:
                ev = _parse_block(block)
                if ev is not None:
                    events.append(ev)
        if len(rest) > self.max_event_bytes:
            raise SSEProtocolError(f"SSE event larger than {self.max_event_bytes} bytes")
        self._buf = rest
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet terminated (non-empty at EOF means a truncated stream)."""
        return self._buf


def _parse_block(block: bytes) -> Event | None:
    data: list[bytes] = []
    comment: list[bytes] = []
    event: str | None = None
    for line in block.split(b"\n"):
        if not line:
            continue
        if line[0:1] == b":":
            comment.append(line[1:].lstrip(b" "))
            continue
        field, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif field == b"event":
            event = value.decode("utf-8", "replace")
        # `id:` and `retry:` are not used by LLM APIs; ignored as the SSE spec allows.
    if data:
        return Event(b"\n".join(data), False, event)
    if comment:
        return Event(b"\n".join(comment), True, event)
    return None
