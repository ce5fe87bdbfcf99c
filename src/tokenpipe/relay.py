"""Moves an upstream SSE stream to the client and measures it on the way.

Per event the work is one JSON parse (to find content and usage) and one append; everything
read from the socket in one go is written to the client in one write, so nothing waits for
more data (no added buffering) and a burst costs one syscall.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from tokenpipe import sse
from tokenpipe.observe import metrics


def chunk_has_content(obj: dict[str, Any]) -> bool:
    """True if a chunk carries output: content, reasoning or a tool call (not a role-only chunk)."""
    choices = obj.get("choices")
    return _choices_have_content(choices) if choices else False


def _choices_have_content(choices: list[dict[str, Any]]) -> bool:
    for choice in choices:
        delta = choice.get("delta")
        if delta is None:  # text completion
            if choice.get("text"):
                return True
        elif (
            delta.get("content")
            or delta.get("tool_calls")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
            or delta.get("function_call")
        ):
            return True
    return False


class StreamTally:
    """What one response did, as the client saw it: first token, gaps, tokens, outcome."""

    __slots__ = (
        "chunks",
        "done",
        "finished",
        "first_token_at",
        "itl",
        "labels",
        "last_token_at",
        "started_at",
        "ttft",
        "usage",
    )

    def __init__(self, upstream: str, model: str, started_at: float) -> None:
        self.labels = (upstream, model)
        self.started_at = started_at  # time.perf_counter() at request arrival
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.chunks = 0  # content chunks
        self.usage: dict[str, Any] | None = None
        self.done = False  # [DONE] seen
        self.finished = False  # a finish_reason seen
        self.ttft: float | None = None
        self.itl = metrics.ITL.labels(*self.labels)

    def observe_content(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
            self.ttft = now - self.started_at
            metrics.TTFT.labels(*self.labels).observe(self.ttft)
        else:
            self.itl.observe(now - self.last_token_at)
        self.last_token_at = now
        self.chunks += 1

    def finish(self, status: int) -> None:
        end = time.perf_counter()
        upstream, model = self.labels
        metrics.REQUEST_DURATION.labels(upstream, model).observe(end - self.started_at)
        metrics.REQUESTS.labels(str(status), upstream, model).inc()
        usage = self.usage
        if usage:
            prompt = usage.get("prompt_tokens") or 0
            completion = usage.get("completion_tokens") or 0
            metrics.TOKENS.labels("prompt", upstream, model).inc(prompt)
            metrics.TOKENS.labels("completion", upstream, model).inc(completion)
            if self.first_token_at is not None and completion > 1:
                tpot = (self.last_token_at - self.first_token_at) / (completion - 1)
                metrics.TPOT.labels(upstream, model).observe(tpot)


class SSERelay:
    """Turns upstream socket reads into bytes for the client, recording the tally."""

    __slots__ = ("decoder", "strip_usage", "tally")

    def __init__(self, tally: StreamTally, strip_usage: bool) -> None:
        self.tally = tally
        #: The gateway asked the upstream for usage on the client's behalf; remove the
        #: usage-only chunk again so the client gets exactly what it asked for.
        self.strip_usage = strip_usage
        self.decoder = sse.SSEDecoder()

    def feed(self, chunk: bytes) -> bytes:
        out: list[bytes] = []
        tally = self.tally
        now = 0.0
        for data, comment, _ in self.decoder.feed(chunk):
            if comment:
                out.append(b": " + data + b"\n\n")
                continue
            if data == sse.DONE:
                tally.done = True
                out.append(sse.DONE_EVENT)
                continue
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                raise sse.SSEProtocolError("upstream sent an event that is not JSON") from None
            if type(obj) is not dict:
                raise sse.SSEProtocolError("upstream sent an event that is not a JSON object")
            choices = obj.get("choices")
            if choices:
                if _choices_have_content(choices):
                    now = now or time.perf_counter()
                    tally.observe_content(now)
                if choices[0].get("finish_reason"):
                    tally.finished = True
            elif "error" in obj:
                tally.finished = True
            if "usage" in obj:
                usage = obj["usage"]
                if usage:
                    tally.usage = usage
                if self.strip_usage:
                    if not choices:
                        continue  # the usage-only chunk the client did not ask for
                    # `"usage": null` is there only because we asked for usage. OpenAI-compatible
                    # servers write it compactly; cutting the bytes avoids a re-serialisation.
                    cut = data.replace(b',"usage":null', b"", 1)
                    if len(cut) == len(data):
                        del obj["usage"]
                        cut = orjson.dumps(obj)
                    data = cut
            out.append(b"data: " + data + b"\n\n")
        return b"".join(out)
