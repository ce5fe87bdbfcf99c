"""The sim's Anthropic Messages API: `POST /v1/messages` (a Message, or its event stream) and
`POST /v1/messages/count_tokens`, with the chat routes' timing, faults and rate limits, in
Anthropic's shapes: its events, its error bodies (a `status:529` fault is its
overloaded_error), its `anthropic-ratelimit-*` headers.

Length: the words of `--output-tokens` (forced by `output_tokens=`), at most the request's
max_tokens (which Messages always sets: a cap, as Anthropic treats it), so stop_reason is
`end_turn` or `max_tokens`. With `tools` in the request and `tool=NAME` (header `x-sim-tool`,
directive `[[sim tool=NAME]]`; `*`: its first tool), the answer calls that tool: the first
half of the words as a text block, the rest as the tool's input `{"text": "<words>"}`,
streamed as input_json_delta parts (one per chunk of words), stop_reason `tool_use`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

import orjson
from aiohttp import web

from tokenpipe.engines.sim import text
from tokenpipe.engines.sim.config import SimConfig, Timing, output_tokens
from tokenpipe.engines.sim.limits import RateLimits, retry_headers
from tokenpipe.engines.sim.records import Record
from tokenpipe.engines.sim.stream import GARBAGE, paced, start


class Sim(Protocol):
    """What these routes use of the sim (app.py's `Sim`): its config, limits and records."""

    config: SimConfig
    limits: RateLimits
    active: int

    def full(self) -> bool: ...
    def timing_for(self, request: web.Request, prompt_text: str) -> Timing: ...
    def record(self, rec: Record) -> None: ...
    def finish(self, rec: Record, outcome: str) -> None: ...


#: status -> Anthropic's error type.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_TEXT_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
_PING = b'event: ping\ndata: {"type":"ping"}\n\n'
#: What opens and closes the tool's input (its JSON text is streamed in parts).
_INPUT_OPEN, _INPUT_CLOSE = '{"text": "', '"}'


@dataclass(slots=True)
class Answer:
    """One request's answer: `tokens[:split]` the text block, the rest the tool's input."""

    id: str
    model: str
    tokens: list[str]
    split: int
    tool: dict[str, str] | None  # {"id", "name"} when it calls one
    stop_reason: str
    input_tokens: int

    @property
    def tool_index(self) -> int:
        """The tool_use block's index (after the text block, if there is one)."""
        return 1 if self.split else 0

    @property
    def has_text_block(self) -> bool:
        return self.tool is None or self.split > 0

    def message(self, content: list[dict[str, Any]], output_tokens: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.stop_reason if content else None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.input_tokens,
                "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }


def error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    kind = _ERROR_TYPES.get(status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


def _prompt(req: dict[str, Any]) -> tuple[str, int]:
    """The request's prompt text (system, then the messages) and its input tokens."""
    messages = req["messages"]
    parts = [_content_text(req.get("system"))]
    parts += [_content_text(m.get("content")) for m in messages]
    prompt_text = " ".join(parts)
    return prompt_text, text.count_tokens(prompt_text) + 4 * len(messages) + 3


async def count_tokens(sim: Sim, body: bytes) -> web.Response:
    try:
        req = orjson.loads(body)
        model = req["model"]
        _, input_tokens = _prompt(req)
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return error(400, "Invalid request body.")
    if not sim.config.any_model and model not in sim.config.models:
        return error(404, f"model: {model}")
    return web.Response(
        body=orjson.dumps({"input_tokens": input_tokens}), content_type="application/json"
    )


async def create(sim: Sim, request: web.Request, body: bytes) -> web.StreamResponse:
    try:
        req = orjson.loads(body)
        model = req["model"]
        max_tokens = req["max_tokens"]
        prompt_text, input_tokens = _prompt(req)
        tools = req.get("tools") or []
        names = [t["name"] for t in tools]
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError):
        return error(400, "Invalid request body.")
    if not sim.config.any_model and model not in sim.config.models:
        return error(404, f"model: {model}")
    try:
        max_tokens = output_tokens(max_tokens)
        timing = sim.timing_for(request, prompt_text)
    except ValueError as e:
        return error(400, str(e))
    n_out = timing.force_output_tokens
    if n_out is None:
        n_out = min(max_tokens, timing.output_tokens)
    rec = Record(
        request.headers.get("x-request-id") or uuid.uuid4().hex,
        "messages",
        time.monotonic(),
        prompt_tokens=input_tokens,
        traceparent=request.headers.get("traceparent"),
    )
    fault = timing.fault
    if fault is not None:
        rec.fault = fault.kind
    sim.record(rec)
    if sim.full():  # Anthropic's overloaded_error
        rec.status = 529
        sim.finish(rec, "error")
        return error(529, "Overloaded", {})
    wait, rl_headers = sim.limits.admit(input_tokens + max_tokens, anthropic=True)
    if wait > 0:
        rec.status = 429
        sim.finish(rec, "error")
        return error(429, "Rate limit reached.", retry_headers(wait, rl_headers))
    if fault is not None and fault.kind == "status":
        rec.status = fault.status
        sim.finish(rec, "error")
        headers = retry_headers(1.0, rl_headers) if fault.status == 429 else rl_headers
        message = "Overloaded" if fault.status == 529 else f"Simulated error {fault.status}."
        return error(fault.status, message, headers)

    name = names[0] if timing.tool == "*" and names else timing.tool
    tool = {"id": "toolu_" + rec.id, "name": name} if name is not None and name in names else None
    reason = "max_tokens" if n_out >= max_tokens else "end_turn"
    if tool is not None:
        reason = "tool_use"
    answer = Answer(
        "msg_" + rec.id,
        model,
        list(islice(text.words(sim.config.seed, prompt_text), n_out)),
        n_out // 2 if tool is not None else n_out,
        tool,
        reason,
        input_tokens,
    )
    sim.active += 1
    try:
        if req.get("stream"):
            return await _stream(sim, request, rec, answer, timing, rl_headers)
        return await _unary(sim, rec, answer, timing, rl_headers)
    except asyncio.CancelledError:
        sim.finish(rec, "cancelled")
        raise
    except ConnectionError:  # the client went away mid-answer (see app.py's chat)
        sim.finish(rec, "cancelled")
        return web.Response(status=499)
    finally:
        sim.active -= 1


async def _unary(
    sim: Sim, rec: Record, answer: Answer, timing: Timing, headers: dict[str, str]
) -> web.Response:
    tokens = answer.tokens
    delay = timing.ttft_ms + max(0, len(tokens) - 1) * timing.itl_ms
    if timing.fault is not None and timing.fault.kind in ("stall-first", "stall"):
        delay += timing.fault.ms
    if delay > 0:
        await asyncio.sleep(delay / 1000)
    content: list[dict[str, Any]] = []
    if answer.has_text_block:
        content.append({"type": "text", "text": "".join(tokens[: answer.split])})
    if answer.tool is not None:
        tool_input = {"text": "".join(tokens[answer.split :])}
        content.append({"type": "tool_use", **answer.tool, "input": tool_input})
    rec.tokens = len(tokens)
    sim.finish(rec, "completed")
    body = answer.message(content, len(tokens))
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **obj}) + b"\n\n"


def _text_delta(index: int, words: str) -> bytes:
    return (
        _TEXT_DELTA
        + str(index).encode()
        + b',"delta":{"type":"text_delta","text":'
        + orjson.dumps(words)
        + b"}}\n\n"
    )


def _json_delta(index: int, part: str) -> bytes:
    delta = {"type": "input_json_delta", "partial_json": part}
    return _event("content_block_delta", {"index": index, "delta": delta})


def _tool_start(answer: Answer) -> bytes:
    block = {"type": "tool_use", **(answer.tool or {}), "input": {}}
    return _event("content_block_start", {"index": answer.tool_index, "content_block": block})


def _escaped(words: str) -> str:
    """Words as they appear inside a JSON string."""
    return orjson.dumps(words)[1:-1].decode()


async def _stream(
    sim: Sim,
    request: web.Request,
    rec: Record,
    answer: Answer,
    timing: Timing,
    headers: dict[str, str],
) -> web.StreamResponse:
    """The Messages event stream, on the schedule and with the faults of stream.py."""
    t0 = asyncio.get_running_loop().time()
    resp, hung = await start(request, rec, timing, headers, sim.finish)
    if hung:
        return resp
    tokens, split, tool = answer.tokens, answer.split, answer.tool
    ti = answer.tool_index
    buf = [_event("message_start", {"message": answer.message([], 0)})]
    if answer.has_text_block:
        block = {"type": "text", "text": ""}
        buf.append(_event("content_block_start", {"index": 0, "content_block": block}))
    buf.append(_PING)
    if timing.fault is not None and timing.fault.kind == "garbage":
        buf.append(GARBAGE)
    await resp.write(b"".join(buf))
    buf.clear()

    def encode(begin: int, stop: int) -> bytes:
        out = []
        text_stop = min(stop, split)
        if begin < text_stop:
            out.append(_text_delta(0, "".join(tokens[begin:text_stop])))
        if tool is not None and stop > split:
            first = max(begin, split)
            part = _escaped("".join(tokens[first:stop]))
            if first == split:  # the tool's block opens with its first words
                if split:
                    out.append(_event("content_block_stop", {"index": 0}))
                out.append(_tool_start(answer))
                part = _INPUT_OPEN + part
            out.append(_json_delta(ti, part))
        return b"".join(out)

    if not await paced(request, resp, rec, len(tokens), timing, t0, encode, buf, sim.finish):
        return resp
    if tool is not None:
        if len(tokens) == split:  # no words for the tool: it opens here
            buf += [_tool_start(answer), _json_delta(ti, _INPUT_OPEN)]
        buf += [_json_delta(ti, _INPUT_CLOSE), _event("content_block_stop", {"index": ti})]
    else:
        buf.append(_event("content_block_stop", {"index": 0}))
    delta = {"stop_reason": answer.stop_reason, "stop_sequence": None}
    buf.append(_event("message_delta", {"delta": delta, "usage": {"output_tokens": len(tokens)}}))
    buf.append(_event("message_stop", {}))
    await resp.write(b"".join(buf))
    await resp.write_eof()
    sim.finish(rec, "completed")
    return resp


def _content_text(content: Any) -> str:
    """The text of a string or of content blocks (text, and a tool_result's own content)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for block in content:
            if isinstance(block, dict):
                if isinstance(block.get("text"), str):
                    out.append(block["text"])
                elif block.get("type") == "tool_result":
                    out.append(_content_text(block.get("content")))
        return " ".join(out)
    return ""
