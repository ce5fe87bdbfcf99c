"""The sim's HTTP app: OpenAI-compatible routes with exact, seeded timing and fault injection.

Timing is an absolute schedule from the moment the request is read: the role chunk at 0, the
first content chunk at ttft, chunk j at ttft + j * tokens_per_chunk * itl. Sleeping to absolute
due times keeps errors from adding up; with zero delays every due time has passed, so events go
out in large writes and the sim sustains far more than 10,000 tokens/s on one core.
"""

from __future__ import annotations

import asyncio
import math
import re
import socket
import struct
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any

import orjson
from aiohttp import web

from tokenpipe import sse
from tokenpipe.control.bucket import TokenBucket
from tokenpipe.control.ratelimit_headers import go_duration
from tokenpipe.engines.sim import faults, text
from tokenpipe.engines.sim.faults import Fault

#: Largest request body the sim reads (bytes).
MAX_BODY = 16 * 1024 * 1024
#: Bytes gathered before a write when events are due faster than they can be written.
WRITE_BATCH = 64 * 1024
#: Kernel send buffer of a streaming connection (bytes; Linux doubles it). Like a server
#: across a real network, the sim holds a bounded amount in flight: a reader that stops
#: reading stops the stream within this many bytes, whatever the machine's tcp_wmem allows.
SEND_BUFFER_BYTES = 256 * 1024
#: Longest a `hang-after-headers` fault holds a connection (seconds).
MAX_HANG = 600.0
#: Request records kept for /sim/stats (oldest dropped first).
MAX_RECORDS = 10_000

_DIRECTIVE = re.compile(r"\[\[sim ([^\]]*)\]\]")


@dataclass(slots=True)
class Timing:
    ttft_ms: float = 50.0
    itl_ms: float = 5.0
    tokens_per_chunk: int = 1
    #: Output length when the request gives no max_tokens.
    output_tokens: int = 64
    #: Fixed output length that overrides max_tokens (set per request, for tests).
    force_output_tokens: int | None = None
    fault: Fault | None = None


@dataclass(slots=True)
class SimConfig:
    seed: int = 0
    timing: Timing = field(default_factory=Timing)
    models: list[str] = field(default_factory=lambda: ["sim-model"])
    #: Accept any model name (else unknown models get 404).
    any_model: bool = True
    rpm: float | None = None
    tpm: float | None = None
    #: Depth of the RPM/TPM buckets in seconds of refill (60: a full minute's allowance).
    bucket_seconds: float = 60.0
    rated_faults: list[tuple[Fault, float]] = field(default_factory=list)


@dataclass(slots=True)
class Record:
    id: str
    kind: str
    started: float  # time.monotonic(), comparable across processes on one machine
    fault: str | None = None
    status: int = 200
    outcome: str = "running"  # running | completed | cancelled | reset | truncated | error
    ended: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0


class Sim:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.dice = faults.FaultDice(config.rated_faults, config.seed)
        self.rpm = self._bucket(config.rpm)
        self.tpm = self._bucket(config.tpm)
        self.records: deque[Record] = deque(maxlen=MAX_RECORDS)
        self.counts: dict[str, int] = {}
        self.active = 0

    def _bucket(self, per_minute: float | None) -> TokenBucket | None:
        if not per_minute:
            return None
        rate = per_minute / 60.0
        return TokenBucket(rate, rate * self.config.bucket_seconds)

    # -- request parameters ---------------------------------------------------------------

    def timing_for(self, request: web.Request, prompt_text: str) -> Timing:
        t = replace(self.config.timing)
        drawn = self.dice.draw()
        if drawn is not None:
            t.fault = drawn
        pairs: dict[str, str] = {}
        for name, value in request.headers.items():
            lname = name.lower()
            if lname.startswith("x-sim-"):
                pairs[lname[6:].replace("-", "_")] = value
        for m in _DIRECTIVE.finditer(prompt_text):
            for item in m.group(1).split():
                k, _, v = item.partition("=")
                pairs[k.replace("-", "_")] = v
        for k, v in pairs.items():
            if k == "ttft_ms":
                t.ttft_ms = float(v)
            elif k == "itl_ms":
                t.itl_ms = float(v)
            elif k == "tokens_per_chunk":
                t.tokens_per_chunk = max(1, int(v))
            elif k == "output_tokens":
                t.force_output_tokens = max(0, int(v))
            elif k == "fault":
                t.fault = None if v in ("", "none") else faults.parse(v)
        return t

    def admit(self, cost_tokens: int) -> tuple[float, dict[str, str]]:
        """Charges the RPM/TPM buckets. Returns (seconds to wait or 0, rate-limit headers)."""
        headers: dict[str, str] = {}
        charges = [(b, n) for b, n in ((self.rpm, 1), (self.tpm, cost_tokens)) if b is not None]
        wait = max((_peek(b, n) for b, n in charges), default=0.0)
        if wait == 0.0:
            for b, n in charges:
                b.take(n)
        for bucket, limit, kind in (
            (self.rpm, self.config.rpm, "requests"),
            (self.tpm, self.config.tpm, "tokens"),
        ):
            if bucket is None or limit is None:
                continue
            headers[f"x-ratelimit-limit-{kind}"] = str(int(limit))
            headers[f"x-ratelimit-remaining-{kind}"] = str(int(bucket.level))
            headers[f"x-ratelimit-reset-{kind}"] = go_duration(bucket.seconds_until_full())
        return wait, headers

    def record(self, rec: Record) -> None:
        self.records.append(rec)

    def finish(self, rec: Record, outcome: str) -> None:
        rec.outcome = outcome
        rec.ended = time.monotonic()
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

    # -- handlers --------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "text")

    async def _complete(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await _read_body(request)
        if body is None:
            return _error(413, "Request too large.")
        try:
            req = orjson.loads(body)
            model = req["model"]
            if kind == "chat":
                messages = req["messages"]
                prompt_text = " ".join(_content_text(m.get("content")) for m in messages)
                prompt_tokens = text.count_tokens(prompt_text) + 4 * len(messages) + 3
            else:
                prompt_text = _prompt_text(req["prompt"])
                prompt_tokens = text.count_tokens(prompt_text)
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            return _error(400, "Invalid request body.")
        if not self.config.any_model and model not in self.config.models:
            return _error(404, f"The model `{model}` does not exist.", code="model_not_found")
        try:
            timing = self.timing_for(request, prompt_text)
        except ValueError as e:
            return _error(400, str(e))
        max_tokens = req.get("max_completion_tokens") or req.get("max_tokens")
        n_out = timing.force_output_tokens
        if n_out is None:
            n_out = int(max_tokens) if max_tokens is not None else timing.output_tokens
        rec = Record(
            request.headers.get("x-request-id") or uuid.uuid4().hex,
            kind,
            time.monotonic(),
            prompt_tokens=prompt_tokens,
        )
        fault = timing.fault
        if fault is not None:
            rec.fault = fault.kind
        self.record(rec)

        wait, rl_headers = self.admit(prompt_tokens + int(max_tokens or timing.output_tokens))
        if wait > 0:
            rec.status = 429
            self.finish(rec, "error")
            return _error(
                429,
                "Rate limit reached. Please try again later.",
                code="rate_limit_exceeded",
                headers=_retry_headers(wait, rl_headers),
            )
        if fault is not None and fault.kind == "status":
            rec.status = fault.status
            self.finish(rec, "error")
            headers = rl_headers
            if fault.status == 429:
                headers = _retry_headers(1.0, rl_headers)
            return _error(fault.status, f"Simulated error {fault.status}.", headers=headers)

        finish_reason = "length" if max_tokens is not None and n_out >= int(max_tokens) else "stop"
        tokens = list(islice(text.words(self.config.seed, prompt_text), n_out))
        stream = bool(req.get("stream"))
        opts = req.get("stream_options") or {}
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n_out,
            "total_tokens": prompt_tokens + n_out,
        }
        self.active += 1
        try:
            if stream:
                return await self._stream(
                    request,
                    rec,
                    kind,
                    model,
                    tokens,
                    timing,
                    finish_reason,
                    usage if opts.get("include_usage") else None,
                    rl_headers,
                )
            return await self._unary(
                rec, kind, model, tokens, timing, finish_reason, usage, rl_headers
            )
        except asyncio.CancelledError:
            self.finish(rec, "cancelled")
            raise
        except ConnectionError:
            # The client went away mid-answer (a hedge's loser, a closed tab): a write met the
            # closing transport before aiohttp cancelled the handler. Counted, not a traceback;
            # aiohttp ignores the failed end of the response quietly.
            self.finish(rec, "cancelled")
            return web.Response(status=499)
        finally:
            self.active -= 1

    async def _unary(
        self,
        rec: Record,
        kind: str,
        model: str,
        tokens: list[str],
        timing: Timing,
        finish_reason: str,
        usage: dict[str, int],
        headers: dict[str, str],
    ) -> web.Response:
        delay = timing.ttft_ms + max(0, len(tokens) - 1) * timing.itl_ms
        if timing.fault is not None and timing.fault.kind in ("stall-first", "stall"):
            delay += timing.fault.ms
        if delay > 0:
            await asyncio.sleep(delay / 1000)
        content = "".join(tokens)
        created = int(time.time())
        cid = "chatcmpl-" + rec.id if kind == "chat" else "cmpl-" + rec.id
        choice: dict[str, Any]
        if kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        rec.tokens = len(tokens)
        self.finish(rec, "completed")
        body = {
            "id": cid,
            "object": obj,
            "created": created,
            "model": model,
            "system_fingerprint": "tokenpipe-sim",
            "choices": [choice],
            "usage": usage,
        }
        return web.Response(
            body=orjson.dumps(body), content_type="application/json", headers=headers
        )

    async def _stream(
        self,
        request: web.Request,
        rec: Record,
        kind: str,
        model: str,
        tokens: list[str],
        timing: Timing,
        finish_reason: str,
        usage: dict[str, int] | None,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        await resp.prepare(request)
        fault = timing.fault
        fkind = fault.kind if fault else None
        if fkind == "hang-after-headers":
            await asyncio.sleep(MAX_HANG)
            self.finish(rec, "completed")
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
        size = 0
        if kind == "chat":
            buf.append(
                sse.encode(
                    head + b'"delta":{"role":"assistant","content":""},'
                    b'"logprobs":null,"finish_reason":null}]' + usage_field + b"}"
                )
            )
        if fkind == "garbage":
            buf.append(b"data: this is not json\n\n")
        await resp.write(b"".join(buf))
        buf.clear()

        per = timing.tokens_per_chunk
        gap = per * timing.itl_ms / 1000.0  # seconds between chunks
        due = t0 + timing.ttft_ms / 1000.0
        if fkind == "stall-first":
            due += fault.ms / 1000.0  # type: ignore[union-attr]
        sent = 0
        stalled = False
        for start in range(0, len(tokens), per):
            if fault is not None and sent >= fault.after and fkind in ("reset", "truncate"):
                if buf:
                    await resp.write(b"".join(buf))
                rec.tokens = sent
                if fkind == "reset":
                    _reset(request)
                    self.finish(rec, "reset")
                    return resp
                self.finish(rec, "truncated")
                await resp.write_eof()
                return resp
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
            piece = "".join(tokens[start : start + per])
            ev = b"data: " + head + content_pre + orjson.dumps(piece) + content_post + b"\n\n"
            buf.append(ev)
            size += len(ev)
            sent += len(tokens[start : start + per])
            due += gap
        rec.tokens = sent
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
        self.finish(rec, "completed")
        return resp

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "tokenpipe-sim"}
            for m in self.config.models
        ]
        return web.Response(
            body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
        )

    async def stats(self, request: web.Request) -> web.Response:
        """Counters and the last request records, for tests and benchmarks."""
        last = int(request.query.get("last", "100"))
        recs = list(self.records)[-last:] if last > 0 else []
        body = {
            "requests": sum(self.counts.values()) + self.active,
            "active": self.active,
            "outcomes": self.counts,
            "records": [
                {
                    "id": r.id,
                    "kind": r.kind,
                    "started": r.started,
                    "ended": r.ended,
                    "outcome": r.outcome,
                    "status": r.status,
                    "fault": r.fault,
                    "tokens": r.tokens,
                    "prompt_tokens": r.prompt_tokens,
                }
                for r in recs
            ],
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def reset_stats(self, request: web.Request) -> web.Response:
        self.records.clear()
        self.counts.clear()
        return web.Response(body=b"{}", content_type="application/json")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/sim/stats", self.stats)
        app.router.add_post("/sim/reset", self.reset_stats)
        app.router.add_get("/healthz", lambda r: _ok())
        return app


async def _ok() -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def _read_body(request: web.Request) -> bytes | None:
    """The whole request body, however many reads it takes; None above MAX_BODY bytes (read
    no further). One `content.read(n)` returns only what is buffered, not n bytes."""
    parts: list[bytes] = []
    size = 0
    while chunk := await request.content.read(MAX_BODY + 1 - size):
        parts.append(chunk)
        size += len(chunk)
        if size > MAX_BODY:
            return None
    return b"".join(parts)


def _peek(bucket: TokenBucket, n: float) -> float:
    """Seconds until n units are in the bucket, without taking them."""
    level = bucket.level
    if n <= level:
        return 0.0
    if n > bucket.capacity:
        return math.inf
    return (n - level) / bucket.rate


def _retry_headers(wait: float, headers: dict[str, str]) -> dict[str, str]:
    wait = 60.0 if math.isinf(wait) else wait
    return {
        **headers,
        "retry-after": str(max(1, math.ceil(wait))),
        "retry-after-ms": str(max(1, math.ceil(wait * 1000))),
    }


def _error(
    status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    types = {
        400: "invalid_request_error",
        404: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
    }
    body = {
        "error": {
            "message": message,
            "type": types.get(status, "server_error"),
            "param": None,
            "code": code,
        }
    }
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


def _reset(request: web.Request) -> None:
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Linger 0: close() sends RST instead of FIN, like a crashed or cut-off server.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(p if isinstance(p, str) else str(p) for p in prompt)
    raise TypeError("prompt")
