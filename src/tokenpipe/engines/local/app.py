"""The local engine's HTTP app: the OpenAI-compatible routes of `tokenpipe sim`, over a real model.

Per request: parse, tokenize (the model's own tokenizer, which also gives `usage`), wait for the
model in the fair queue, decode in the one decode thread, and relay pieces from the bounded
hand-off to the socket. A streamed response takes the next piece only after the socket took the
last one (`drain`), and its socket buffers are kept small, so a client that stops reading stops
the model within a few dozen tokens.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson
from aiohttp import web

from tokenpipe import sse
from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control.flowgate import FlowGate
from tokenpipe.engines.local import decode, metrics, refusals
from tokenpipe.engines.local.decode import Done, Failed, Item, Record, SamplingParams
from tokenpipe.engines.local.handoff import TokenHandoff
from tokenpipe.engines.local.model import MODEL_ID, LoadedModel
from tokenpipe.engines.local.prompt import PromptError, chat_segments
from tokenpipe.engines.local.queue import ModelSlot
from tokenpipe.errors import GatewayError
from tokenpipe.front.pacing import pace_gate
from tokenpipe.observe.metrics import render

#: Largest request body read (bytes); a longer one gets 413.
MAX_BODY = 4 * 1024 * 1024
#: Request records kept for /local/stats (oldest dropped first). Each holds its token
#: timestamps (8 bytes + a float object per token, at most the context window): 200 records of
#: a full 4096-token window are ~25 MB at worst.
MAX_RECORDS = 200
#: Kernel send buffer of a streaming connection (bytes; Linux doubles it). A few dozen chunks:
#: at the model's ~100 tokens/s that is well over the bandwidth-delay product of any real
#: network path, yet small enough that a stalled reader stops decoding within a second.
SEND_BUFFER_BYTES = 4096
#: The event loop's write buffer above which a stream waits for the socket (bytes).
WRITE_HIGH_WATER = 4096

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    #: Requests that may wait for the model; one more gets 503 + Retry-After.
    max_waiting: int = 16
    #: Longest wait for the model (seconds); then 503 + Retry-After.
    max_wait_seconds: float = 30.0
    #: Longest the decode thread waits for a client that stopped reading (seconds); then the
    #: stream ends with an error and the model goes to the next request.
    max_pause_seconds: float = 30.0
    #: Pieces in the hand-off between the decode thread and the event loop.
    handoff_tokens: int = 4
    #: Output cap when a request gives no max_tokens (tokens; finish_reason "length" at it).
    #: The pretrained model rarely ends a turn by itself: without a cap one request would fill
    #: the whole context window (4,096 tokens, some two minutes on 2 cores).
    default_max_tokens: int = 256


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    #: The rate (tokens/s) the reader renders at; decoding is paced to it (see `_stream`).
    max_tokens_per_second: float | None = None


class _Params(msgspec.Struct, kw_only=True):
    model: str = MODEL_ID
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    ignore_eos: bool = False
    # Accepted only to be refused when they ask for what the model cannot do (refusals.py).
    tools: list[Any] | None = None
    tool_choice: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    response_format: Any = None


class ChatRequest(_Params, kw_only=True):
    messages: list[dict[str, Any]]


class CompletionRequest(_Params, kw_only=True):
    prompt: Any


class LocalServer:
    def __init__(
        self, model: LoadedModel, config: EngineConfig | None = None, clock: Clock = MONOTONIC
    ) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.slot = ModelSlot(self.config.max_waiting, self.config.max_wait_seconds, clock)
        # One thread: the model decodes one sequence at a time (the slot guarantees it).
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenpipe-decode")
        self.records: deque[Record] = deque(maxlen=MAX_RECORDS)
        metrics.WAITING.set_function(lambda: self.slot.waiting)

    # -- routes ----------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await _read(request, ChatRequest)
        try:
            prompt = self.model.encode_segments(chat_segments(req.messages))
        except PromptError as e:
            raise GatewayError(400, str(e), param="messages") from None
        return await self._complete(request, "chat", req, prompt)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await _read(request, CompletionRequest)
        p = req.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            prompt = self.model.encode_text(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            prompt = list(p)  # token ids, as OpenAI allows
        else:
            raise GatewayError(
                400,
                "prompt must be a string or a list of token ids (one prompt per request)",
                param="prompt",
            )
        return await self._complete(request, "text", req, prompt)

    async def models(self, request: web.Request) -> web.Response:
        # max_model_len (vLLM's name): the context window, for clients that budget prompts.
        data = [
            {
                "id": MODEL_ID,
                "object": "model",
                "created": 0,
                "owned_by": "tokenpipe-local",
                "max_model_len": self.model.n_ctx,
            }
        ]
        return _json({"object": "list", "data": data})

    async def stats(self, request: web.Request) -> web.Response:
        """Queue state and per-request records with token timestamps, for tests and benchmarks.
        ?id=REQUEST_ID picks one request; ?last=N the last N; ?times=0 leaves out timestamps."""
        want = request.query.get("id")
        times = request.query.get("times", "1") != "0"
        recs = list(self.records)
        if want is not None:
            recs = [r for r in recs if r.id == want]
        else:
            try:
                last = int(request.query.get("last", "20"))
            except ValueError:
                raise GatewayError(400, "last must be an integer", param="last") from None
            recs = recs[-last:] if last > 0 else []
        return _json(
            {
                "busy": self.slot.busy,
                "waiting": self.slot.waiting,
                "records": [r.as_dict(times) for r in recs],
            }
        )

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    # -- one generation --------------------------------------------------------------------

    def _params(self, req: _Params, n_prompt: int) -> SamplingParams:
        if req.n not in (None, 1):
            raise GatewayError(400, "n must be 1 with the local model", param="n")
        refusals.check(
            tools=req.tools,
            tool_choice=req.tool_choice,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
            response_format=req.response_format,
        )
        room = self.model.n_ctx - n_prompt
        if room <= 0:
            raise GatewayError(
                400,
                f"The prompt has {n_prompt} tokens; the local model's context "
                f"window is {self.model.n_ctx}.",
                code="context_length_exceeded",
                param="messages",
            )
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, room)
        if max_tokens < 0 or max_tokens > room:
            raise GatewayError(
                400,
                f"max_tokens must be between 0 and {room} (the context window "
                f"of {self.model.n_ctx} less {n_prompt} prompt tokens).",
                code="context_length_exceeded",
                param="max_tokens",
            )
        p = SamplingParams(max_tokens=max_tokens, seed=req.seed, ignore_eos=req.ignore_eos)
        if req.temperature is not None:
            if not 0 <= req.temperature <= 2:
                raise GatewayError(400, "temperature must be between 0 and 2", param="temperature")
            p.temperature = req.temperature
        if req.top_p is not None:
            p.top_p = req.top_p
        if req.top_k is not None:
            p.top_k = req.top_k
        if req.min_p is not None:
            p.min_p = req.min_p
        if req.presence_penalty is not None:
            p.presence_penalty = req.presence_penalty
        if req.frequency_penalty is not None:
            p.frequency_penalty = req.frequency_penalty
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
        if len(stop) > 4:
            raise GatewayError(400, "at most 4 stop sequences", param="stop")
        p.stop = tuple(stop)
        return p

    async def _complete(
        self, request: web.Request, kind: str, req: _Params, prompt: list[int]
    ) -> web.StreamResponse:
        params = self._params(req, len(prompt))
        rid = request.headers.get("x-request-id", "")
        if not _REQUEST_ID.match(rid):  # it goes into ids and headers: only safe characters
            rid = uuid.uuid4().hex
        client = request.headers.get("x-tokenpipe-client") or request.remote or "-"
        rec = Record(rid, kind, client, time.monotonic(), len(prompt), params.max_tokens)
        self.records.append(rec)
        try:
            queue_s = await self.slot.acquire(client)
        except GatewayError as e:
            rec.outcome, rec.error, rec.ended = "rejected", e.code, time.monotonic()
            metrics.REJECTED.labels(e.code or "unknown").inc()
            raise
        except asyncio.CancelledError:
            rec.outcome, rec.ended = "cancelled", time.monotonic()
            raise
        rec.queue_ms = queue_s * 1000
        loop = asyncio.get_running_loop()
        handoff: TokenHandoff[Item] = TokenHandoff(
            loop, self.config.handoff_tokens, self.config.max_pause_seconds
        )
        rec.handoff = handoff
        try:
            job = loop.run_in_executor(
                self.executor, decode.run, self.model, prompt, params, handoff, rec
            )
        except BaseException:
            self.slot.release()
            raise
        # The model goes to the next request when the decode thread is done with it, not when
        # this handler returns: a cancelled handler must not let two sequences share the model.
        job.add_done_callback(lambda _: self._finished(rec))
        model = req.model
        try:
            if req.stream:
                usage = bool(req.stream_options and req.stream_options.include_usage)
                opts = req.stream_options
                gate = pace_gate(request.headers, opts.max_tokens_per_second if opts else None)
                return await self._stream(request, rec, kind, model, handoff, usage, gate)
            return await self._unary(rec, kind, model, handoff)
        finally:
            handoff.close()  # no-op after the end; else stops the decode thread at once

    def _finished(self, rec: Record) -> None:
        self.slot.release()
        metrics.observe(rec)

    async def _unary(
        self, rec: Record, kind: str, model: str, handoff: TokenHandoff[Item]
    ) -> web.Response:
        parts: list[str] = []
        while True:
            item = await handoff.get()
            if isinstance(item, str):
                parts.append(item)
                continue
            if isinstance(item, Failed):
                raise GatewayError(500, item.message, code="model_error")
            break
        finish = item.finish_reason
        text = "".join(parts)
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
        body = {
            "id": _id(kind, rec.id),
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": "tokenpipe-local",
            "choices": [choice],
            "usage": _usage(rec),
        }
        headers = {"x-request-id": rec.id, **timing_headers(rec)}
        return web.Response(
            body=orjson.dumps(body), content_type="application/json", headers=headers
        )

    async def _stream(
        self,
        request: web.Request,
        rec: Record,
        kind: str,
        model: str,
        handoff: TokenHandoff[Item],
        include_usage: bool,
        gate: FlowGate | None = None,
    ) -> web.StreamResponse:
        """Tokens go out as the socket takes them, or at the pace `gate` allows: this handler
        takes a piece from the hand-off only when it may send it, so with a pace the hand-off
        fills and the decode thread waits (decoding slows to the pace; nothing piles up)."""
        resp = web.StreamResponse(headers={**_SSE_HEADERS, "x-request-id": rec.id})
        writer = await resp.prepare(request)
        assert writer is not None
        _small_buffers(request)
        chunks = _Chunks(kind, _id(kind, rec.id), model, include_usage)
        if kind == "chat":
            await resp.write(chunks.role())
        end: Done | Failed | None = None
        while end is None:
            allowed = 1 << 30
            if gate is not None:
                allowed, wait = gate.allowance()
                if allowed < 1:
                    await asyncio.sleep(wait)
                    continue
            item: Item | None = await handoff.get()
            out: list[bytes] = []
            while item is not None:  # everything already decoded goes out in one write
                if isinstance(item, str):
                    out.append(chunks.content(item))
                    if len(out) >= allowed:
                        break
                    item = handoff.get_nowait()
                else:
                    end = item
                    break
            if gate is not None:
                gate.consume(len(out))
            if out:
                await resp.write(b"".join(out))
                await writer.drain()  # the pause: no next piece until the socket took this
        if isinstance(end, Failed):
            err = GatewayError(500, end.message, code="model_error")
            await resp.write(sse.encode(err.json()))
            return resp  # no [DONE]: the client sees the stream did not complete
        tail = [chunks.finish(end.finish_reason)]
        if include_usage:
            tail.append(chunks.usage(_usage(rec)))
        tail.append(sse.encode_comment(timing_comment(rec)))
        tail.append(sse.DONE_EVENT)
        await resp.write(b"".join(tail))
        await resp.write_eof()
        return resp

    # -- app -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[_errors])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/local/stats", self.stats)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/healthz", _healthz)

        async def shutdown(_: web.Application) -> None:
            self.executor.shutdown(wait=False, cancel_futures=True)

        app.on_cleanup.append(shutdown)
        return app


class _Chunks:
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


def _usage(rec: Record) -> dict[str, int]:
    return {
        "prompt_tokens": rec.prompt_tokens,
        "completion_tokens": rec.completion_tokens,
        "total_tokens": rec.prompt_tokens + rec.completion_tokens,
    }


def _id(kind: str, rid: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + rid


def _small_buffers(request: web.Request) -> None:
    """Keeps the bytes between the model and a stalled reader small (see SEND_BUFFER_BYTES)."""
    transport = request.transport
    if transport is None:
        return
    transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


_Req = Any


async def _read(request: web.Request, kind: type[_Req]) -> Any:
    body = await request.content.read(MAX_BODY + 1)
    if len(body) > MAX_BODY:
        raise GatewayError(413, f"Request body larger than {MAX_BODY} bytes.")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise GatewayError(400, f"Invalid request: {e}") from None
    except msgspec.DecodeError:
        raise GatewayError(400, "The request body is not valid JSON.") from None


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


async def _healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok", "model": MODEL_ID})


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error as OpenAI error JSON, with its headers (Retry-After on 503)."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except GatewayError as e:
        return web.Response(
            status=e.status, body=e.json(), content_type="application/json", headers=e.headers
        )
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = GatewayError(e.status, e.reason)
        return web.Response(status=e.status, body=err.json(), content_type="application/json")
