"""Turns the bytes of an SSE response into a `RequestRecord` with as little work per token as
correctness allows.

Most chunks of an OpenAI stream are `data: {...,"delta":{"content":"x"},...}`; for those a byte
search says "content" without a JSON parse. A chunk with usage, an error, a finish reason or no
plain content (role-only, reasoning, tool calls) is parsed with orjson and judged by
`tokenpipe.dialects.openai.chunk_has_content`, the gateway's own rule.
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenpipe import sse
from tokenpipe.bench.metrics import RequestRecord
from tokenpipe.dialects.openai import chunk_has_content

# `"content":"` followed by any byte but `"` is a non-empty content string. Inside a JSON
# string a quote is escaped (`\"`), so this cannot match text the model wrote.
_CONTENT = b'"content":"'
_CONTENT_LEN = len(_CONTENT)
_TEXT = b'"text":"'  # /v1/completions
_NEEDS_PARSE = (b'"usage":{', b'"error"', b'"finish_reason":"')

#: Server phases a tokenpipe upstream reports, by header name.
SERVER_HEADERS = {
    "x-tokenpipe-queue-ms": "queue",
    "x-tokenpipe-limiter-ms": "limiter_wait",
    "x-tokenpipe-limiter-wait-ms": "limiter_wait",
    "x-tokenpipe-prefill-ms": "prefill",
    "x-tokenpipe-decode-ms": "decode",
}
#: A tokenpipe gateway's Server-Timing names -> the phase names above and its own (the
#: gateway's queue is the limiter wait; the engine's queue behind it keeps the name `queue`).
SERVER_TIMING = {
    "edge": "edge",
    "admission": "admission",
    "context": "context",
    "queue": "limiter_wait",
    "upstream_headers": "upstream_headers",
    "upstream_queue": "queue",
    "prefill": "prefill",
    "decode": "decode",
    "total": "total",
}


def server_phases_from_headers(headers: Any, into: dict[str, float]) -> None:
    for name, phase in SERVER_HEADERS.items():
        v = headers.get(name)
        if v is not None:
            try:
                into[phase] = float(v)
            except ValueError:
                pass
    timing = headers.get("server-timing")
    if timing:
        server_timing(timing, into)


def server_timing(value: str, into: dict[str, float]) -> None:
    """The `dur` of each known metric of a Server-Timing value (`name;dur=1.5, ...`), by the
    phase names of SERVER_TIMING; other metrics and malformed entries are skipped."""
    for metric in value.split(","):
        name, *params = metric.split(";")
        phase = SERVER_TIMING.get(name.strip())
        if phase is None:
            continue
        for param in params:
            k, sep, v = param.partition("=")
            if sep and k.strip() == "dur":
                try:
                    into[phase] = float(v.strip().strip('"'))
                except ValueError:
                    pass


def _server_phases_from_comment(text: bytes, into: dict[str, float]) -> None:
    """`: tokenpipe queue_ms=3.1 prefill_ms=40 decode_ms=900` -> {queue: 3.1, ...}: an engine's
    phases, or a gateway's at the end of a stream (first_token_ms, max_gap_ms, total_ms)."""
    if not text.startswith(b"tokenpipe "):
        return
    for item in text[10:].split():
        k, sep, v = item.partition(b"=")
        if sep and k.endswith(b"_ms"):
            try:
                into[k[:-3].decode()] = float(v)
            except ValueError:
                pass


def _fast_content(data: bytes) -> bool:
    for marker in (_CONTENT, _TEXT):
        i = data.find(marker)
        if i >= 0 and data[i + len(marker) : i + len(marker) + 1] != b'"':
            return True
    return False


class Recorder:
    """One stream's recorder: socket reads go to `feed`, which fills `record` (each API's
    subclass reads its own events); `done` once the stream's terminal event arrived."""

    __slots__ = ("decoder", "done", "record")

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.decoder = sse.SSEDecoder()
        self.done = False


class StreamRecorder(Recorder):
    """Chat and completions streams. `done` once `[DONE]` arrived."""

    __slots__ = ()

    def feed(self, data: bytes, now: float) -> None:
        rec = self.record
        for ev in self.decoder.feed(data):
            payload = ev.data
            if ev.comment:
                _server_phases_from_comment(payload, rec.server_ms)
                continue
            if payload == sse.DONE:
                self.done = True
                continue
            if _fast_content(payload) and not any(m in payload for m in _NEEDS_PARSE):
                rec.chunk_times.append(now)
                continue
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                rec.error = "stream: an event that is not JSON"
                continue
            if not isinstance(obj, dict):
                rec.error = "stream: an event that is not a JSON object"
                continue
            if chunk_has_content(obj):
                rec.chunk_times.append(now)
            usage = obj.get("usage")
            if usage:
                rec.usage_completion_tokens = usage.get("completion_tokens")
                rec.usage_prompt_tokens = usage.get("prompt_tokens")
            for choice in obj.get("choices") or ():
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
            err = obj.get("error")
            if err:
                msg = err.get("message") if isinstance(err, dict) else str(err)
                rec.error = f"stream error: {msg}"

    def close(self, now: float) -> None:
        """End of the response body. A stream without `[DONE]` is an error (cut off)."""
        rec = self.record
        rec.end_at = now
        if rec.error is None and not self.done:
            rec.error = "stream ended without [DONE]"
