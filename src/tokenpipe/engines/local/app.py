"""The local engine's HTTP app: the OpenAI-compatible routes of `tokenpipe sim`, over a real model.

Per request: parse, tokenize (the model's own tokenizer, which also gives `usage`), wait for the
model in the fair queue, decode in the one decode thread, and relay pieces from the bounded
hand-off to the socket. A streamed response takes the next piece only after the socket took the
last one (`drain`), and its socket buffers are kept small, so a client that stops reading stops
the model within a few dozen tokens. Request bodies are in schema.py, response bytes in
responses.py.
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

import orjson
from aiohttp import web

from tokenpipe import sse
from tokenpipe.clock import MONOTONIC, Clock
from tokenpipe.control.flowgate import FlowGate
from tokenpipe.control.pacing import pace_gate
from tokenpipe.engines.local import decode, metrics
from tokenpipe.engines.local.decode import Done, Failed, Item, Record
from tokenpipe.engines.local.handoff import TokenHandoff
from tokenpipe.engines.local.model import MODEL_ID, LoadedModel
from tokenpipe.engines.local.prompt import PromptError, chat_segments
from tokenpipe.engines.local.queue import ModelSlot
from tokenpipe.engines.local.responses import (
    StreamChunks,
    completion_body,
    completion_id,
    timing_comment,
    timing_headers,
    usage_of,
)
from tokenpipe.engines.local.schema import (
    MAX_BODY,
    ChatRequest,
    CompletionRequest,
    RequestBody,
    read_request,
    sampling_params,
)
from tokenpipe.errors import GatewayError
from tokenpipe.observe.metrics import render

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
        req = await read_request(request, ChatRequest)
        try:
            prompt = self.model.encode_segments(chat_segments(req.messages))
        except PromptError as e:
            raise GatewayError(400, str(e), param="messages") from None
        return await self._complete(request, "chat", req, prompt)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await read_request(request, CompletionRequest)
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

    async def _complete(
        self, request: web.Request, kind: str, req: RequestBody, prompt: list[int]
    ) -> web.StreamResponse:
        params = sampling_params(req, len(prompt), self.model.n_ctx, self.config.default_max_tokens)
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
        body = completion_body(kind, rec, model, "".join(parts), finish)
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
        chunks = StreamChunks(kind, completion_id(kind, rec.id), model, include_usage)
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
            tail.append(chunks.usage(usage_of(rec)))
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


def _small_buffers(request: web.Request) -> None:
    """Keeps the bytes between the model and a stalled reader small (see SEND_BUFFER_BYTES)."""
    transport = request.transport
    if transport is None:
        return
    transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


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
