"""The bytes of a local answer: stream chunks, the unary body, usage, and the timing headers and
SSE comment that tell a client (and the gateway) where the time went."""

from __future__ import annotations

import time
from typing import Any

import orjson

from tokenpipe import sse
from tokenpipe.engines.local.decode import Record


class StreamChunks:
    """Stream chunk bytes; the constant parts are built once per request, so each token costs
    one orjson.dumps of its text and a few concatenations."""

    def __init__(self, kind: str, cid: str, model: str, include_usage: bool) -> None:
        self.kind = kind
        created = str(int(time.time())).encode()
        obj = b"chat.completion.chunk" if kind == "chat" else b"text_completion"
        self.head = (
            b'{"id":'
            + orjson.dumps(cid)
            + b',"object":"'
            + obj
            + b'","created":'
            + created
            + b',"model":'
            + orjson.dumps(model)
            + b',"system_fingerprint":"tokenpipe-local","choices":'
        )
        self.usage_null = b',"usage":null' if include_usage else b""
        if kind == "chat":
            self.pre = self.head + b'[{"index":0,"delta":{"content":'
            self.post = b'},"logprobs":null,"finish_reason":null}]' + self.usage_null + b"}\n\n"
        else:
            self.pre = self.head + b'[{"index":0,"text":'
            self.post = b',"logprobs":null,"finish_reason":null}]' + self.usage_null + b"}\n\n"
        self.pre = b"data: " + self.pre

    def role(self) -> bytes:
        return sse.encode(
            self.head + b'[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]' + self.usage_null + b"}"
        )

    def content(self, text: str) -> bytes:
        return self.pre + orjson.dumps(text) + self.post

    def finish(self, reason: str) -> bytes:
        delta = b'"delta":{}' if self.kind == "chat" else b'"text":""'
        return sse.encode(
            self.head + b'[{"index":0,' + delta + b',"logprobs":null,'
            b'"finish_reason":' + orjson.dumps(reason) + b"}]" + self.usage_null + b"}"
        )

    def usage(self, usage: dict[str, int]) -> bytes:
        return sse.encode(self.head + b'[],"usage":' + orjson.dumps(usage) + b"}")


def timing_headers(rec: Record) -> dict[str, str]:
    return {
        "x-tokenpipe-queue-ms": f"{rec.queue_ms:.1f}",
        "x-tokenpipe-prefill-ms": f"{rec.prefill_ms:.1f}",
        "x-tokenpipe-decode-ms": f"{rec.decode_ms:.1f}",
    }


def timing_comment(rec: Record) -> bytes:
    return (
        f"tokenpipe queue_ms={rec.queue_ms:.1f} prefill_ms={rec.prefill_ms:.1f} "
        f"decode_ms={rec.decode_ms:.1f}"
    ).encode()


def usage_of(rec: Record) -> dict[str, int]:
    return {
        "prompt_tokens": rec.prompt_tokens,
        "completion_tokens": rec.completion_tokens,
        "total_tokens": rec.prompt_tokens + rec.completion_tokens,
    }


def completion_id(kind: str, rid: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + rid


def completion_body(kind: str, rec: Record, model: str, text: str, finish: str) -> dict[str, Any]:
    """A whole (unary) chat or text completion."""
    choice: dict[str, Any]
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {
        "id": completion_id(kind, rec.id),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "tokenpipe-local",
        "choices": [choice],
        "usage": usage_of(rec),
    }
