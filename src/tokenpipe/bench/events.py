"""Recorders of typed-event streams (`event: NAME` + `data: {"type": NAME, ...}`): OpenAI's
Responses API and Anthropic's Messages API. Each has `stream.StreamRecorder`'s interface
(`feed(bytes, now)`, `close(now)`) and fills a `RequestRecord` the same way, so every metric
means the same in every API.

Content (what TTFT waits for, what ITL spaces), as the gateway counts it:
- Responses: an event `response.<...>.delta` with a non-empty `delta` (output text, function
  call arguments, reasoning text). Usage from the terminal `response.completed` or
  `response.incomplete` (its `usage.output_tokens`); `response.failed` and `error` are errors.
- Messages: a `content_block_delta` with non-empty text, partial_json or thinking. Usage from
  message_start (input) and message_delta (output tokens so far, cumulative); the stream ends
  with message_stop; an `error` event is an error.

The `event:` line says what an event is, so content events and the bulky ones (a Responses
`response.created` holds the whole request echoed) pass without a JSON parse; only the
terminal, usage and error events are parsed, and any event without an `event:` line.
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenpipe.bench.metrics import RequestRecord
from tokenpipe.bench.stream import Recorder, _server_phases_from_comment

# Messages: delta type -> its content field, the gateway's own rule of what a token is
# (signature and citation deltas carry none), as chat's is `chunk_has_content`.
from tokenpipe.dialects.anthropic import _CONTENT

#: Responses events the recorder reads the body of (the rest: only their name matters).
_RESPONSES_PARSED = frozenset(
    ("response.completed", "response.incomplete", "response.failed", "error")
)
_EMPTY_DELTA = b'"delta":""'
#: Messages events that carry nothing the record keeps.
_MESSAGES_SKIPPED = frozenset(("ping", "content_block_start", "content_block_stop"))
# A content delta as Anthropic (and the sim, and the gateway) writes it, followed by any byte
# but `"`: non-empty content, no parse needed. Inside a JSON string every quote is escaped, so
# text the model wrote cannot match. Any other delta (a signature, citations, another key
# order) is judged on the parsed event.
_CONTENT_MARKERS = tuple(f'"type":"{kind}","{key}":"'.encode() for kind, key in _CONTENT.items())


def _fast_content(payload: bytes) -> bool:
    for marker in _CONTENT_MARKERS:
        i = payload.find(marker)
        if i >= 0:
            return payload[i + len(marker) : i + len(marker) + 1] != b'"'
    return False


def _load(rec: RequestRecord, payload: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        rec.error = "stream: an event that is not JSON"
        return None
    if not isinstance(obj, dict):
        rec.error = "stream: an event that is not a JSON object"
        return None
    return obj


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err.get("type") or err)
    return str(err)


def _count(value: Any) -> int | None:
    return value if type(value) is int else None


class ResponsesRecorder(Recorder):
    """One Responses stream. `done` once a terminal event arrived."""

    __slots__ = ()

    def feed(self, data: bytes, now: float) -> None:
        rec = self.record
        for ev in self.decoder.feed(data):
            payload = ev.data
            if ev.comment:
                _server_phases_from_comment(payload, rec.server_ms)
                continue
            kind = ev.event
            if kind is not None:
                if kind.endswith(".delta"):
                    if payload.find(_EMPTY_DELTA) < 0:
                        rec.chunk_times.append(now)
                    continue
                if kind not in _RESPONSES_PARSED:
                    continue
            obj = _load(rec, payload)
            if obj is None:
                continue
            self._event(obj, obj.get("type") or kind or "", now)

    def _event(self, obj: dict[str, Any], kind: str, now: float) -> None:
        rec = self.record
        if kind.endswith(".delta"):  # no `event:` line: judged on its body
            if obj.get("delta"):
                rec.chunk_times.append(now)
            return
        if kind == "error":
            rec.error = f"stream error: {_error_text(obj.get('error') or obj.get('message'))}"
            self.done = True
            return
        response = obj.get("response")
        if kind not in _RESPONSES_PARSED or not isinstance(response, dict):
            return
        self.done = True
        if kind == "response.failed":
            rec.error = f"stream error: {_error_text(response.get('error'))}"
            return
        rec.finish_reason = str(response.get("status") or kind[9:])
        usage = response.get("usage")
        if isinstance(usage, dict):
            rec.usage_completion_tokens = _count(usage.get("output_tokens"))
            rec.usage_prompt_tokens = _count(usage.get("input_tokens"))

    def close(self, now: float) -> None:
        """End of the body: a stream without its terminal event was cut off."""
        rec = self.record
        rec.end_at = now
        if rec.error is None and not self.done:
            rec.error = "stream ended without response.completed"


class MessagesRecorder(Recorder):
    """One Messages stream. `done` once message_stop (or an error event) arrived."""

    __slots__ = ()

    def feed(self, data: bytes, now: float) -> None:
        rec = self.record
        for ev in self.decoder.feed(data):
            payload = ev.data
            if ev.comment:
                _server_phases_from_comment(payload, rec.server_ms)
                continue
            kind = ev.event
            if kind == "content_block_delta" and _fast_content(payload):
                rec.chunk_times.append(now)
                continue
            if kind in _MESSAGES_SKIPPED:
                continue
            obj = _load(rec, payload)
            if obj is not None:
                self._event(obj, obj.get("type") or kind or "", now)

    def _event(self, obj: dict[str, Any], kind: str, now: float) -> None:
        rec = self.record
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict):
                key = _CONTENT.get(delta.get("type") or "")
                if key is not None and delta.get(key):
                    rec.chunk_times.append(now)
        elif kind == "message_start":
            message = obj.get("message")
            if isinstance(message, dict):  # its output_tokens is a placeholder (0 or 1)
                self._usage(message.get("usage"), output=False)
        elif kind == "message_delta":
            self._usage(obj.get("usage"))
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("stop_reason"):
                rec.finish_reason = str(delta["stop_reason"])
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            rec.error = f"stream error: {_error_text(obj.get('error'))}"
            self.done = True

    def _usage(self, usage: Any, output: bool = True) -> None:
        """Anthropic's usage is cumulative: a later count replaces an earlier one."""
        if not isinstance(usage, dict):
            return
        rec = self.record
        out, inp = _count(usage.get("output_tokens")), _count(usage.get("input_tokens"))
        if out is not None and output:
            rec.usage_completion_tokens = out
        if inp is not None:
            rec.usage_prompt_tokens = inp

    def close(self, now: float) -> None:
        """End of the body: a stream without message_stop was cut off."""
        rec = self.record
        rec.end_at = now
        if rec.error is None and not self.done:
            rec.error = "stream ended without message_stop"
