"""The sim's HTTP app: OpenAI-compatible routes, and Anthropic's Messages (messages.py), with
exact, seeded timing and fault injection.

The routes parse a request, settle its timing (config.py), charge the rate limits (limits.py) and
answer whole or streamed (stream.py); /sim/stats reports what each request did (records.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from itertools import islice
from typing import Any

import orjson
from aiohttp import web

from tokenpipe.engines.sim import embeddings as sim_embeddings
from tokenpipe.engines.sim import faults, messages, text
from tokenpipe.engines.sim import responses as sim_responses
from tokenpipe.engines.sim.config import SimConfig, Timing, output_tokens, request_timing
from tokenpipe.engines.sim.limits import RateLimits, retry_headers
from tokenpipe.engines.sim.records import Record
from tokenpipe.engines.sim.stream import stream_completion, stream_events

#: Largest request body the sim reads (bytes).
MAX_BODY = 16 * 1024 * 1024
#: Request records kept for /sim/stats (oldest dropped first).
MAX_RECORDS = 10_000


class Sim:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.dice = faults.FaultDice(config.rated_faults, config.seed)
        self.limits = RateLimits(config.rpm, config.tpm, config.bucket_seconds)
        self.records: deque[Record] = deque(maxlen=MAX_RECORDS)
        self.counts: dict[str, int] = {}
        self.active = 0

    # -- request parameters ---------------------------------------------------------------

    def timing_for(self, request: web.Request, prompt_text: str) -> Timing:
        return request_timing(self.config.timing, self.dice.draw(), request.headers, prompt_text)

    def full(self) -> bool:
        """All `max_active` slots answer now: a new request is refused (503), not queued."""
        cap = self.config.max_active
        return cap is not None and self.active >= cap

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

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "responses")

    async def _complete(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await _read_body(request)
        if body is None:
            return _error(413, "Request too large.")
        try:
            req = orjson.loads(body)
            model = req["model"]
            if kind == "chat":
                messages = req["messages"]
                prompt_text = " ".join(text.content_text(m.get("content")) for m in messages)
                prompt_tokens = text.count_tokens(prompt_text) + 4 * len(messages) + 3
            elif kind == "responses":
                prompt_text, prompt_tokens = sim_responses.prompt_of(req)
            else:
                prompt_text = text.prompt_text(req["prompt"])
                prompt_tokens = text.count_tokens(prompt_text)
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            return _error(400, "Invalid request body.")
        if not self.config.any_model and model not in self.config.models:
            return _error(404, f"The model `{model}` does not exist.", code="model_not_found")
        try:
            timing = self.timing_for(request, prompt_text)
        except ValueError as e:
            return _error(400, str(e))
        max_tokens = (
            req.get("max_completion_tokens")
            or req.get("max_tokens")
            or req.get("max_output_tokens")
        )
        if max_tokens is not None:
            try:
                max_tokens = output_tokens(max_tokens)
            except ValueError as e:
                return _error(400, str(e))
        n_out = timing.force_output_tokens
        if n_out is None:
            n_out = max_tokens if max_tokens is not None else timing.output_tokens
        rec, refusal, rl_headers = self._admit(
            request,
            kind,
            timing,
            prompt_tokens,
            prompt_tokens + (max_tokens or timing.output_tokens),
        )
        if refusal is not None:
            return refusal
        finish_reason = "length" if max_tokens is not None and n_out >= max_tokens else "stop"
        call = sim_responses.forced_call(req) if kind != "text" else None
        if call is not None and finish_reason == "stop" and kind == "chat":
            finish_reason = "tool_calls"
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
            if stream and kind == "responses":
                frames = sim_responses.ResponsesFrames(rec, model, req, finish_reason, usage, call)
                return await stream_events(
                    request, rec, frames, tokens, timing, rl_headers, self.finish
                )
            if stream:
                return await stream_completion(
                    request,
                    rec,
                    kind,
                    model,
                    tokens,
                    timing,
                    finish_reason,
                    usage if opts.get("include_usage") else None,
                    rl_headers,
                    self.finish,
                    call,
                )
            return await self._unary(
                rec, kind, model, tokens, timing, finish_reason, usage, rl_headers, req, call
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

    def _admit(
        self, request: web.Request, kind: str, timing: Timing, prompt_tokens: int, cost: int
    ) -> tuple[Record, web.Response | None, dict[str, str]]:
        """Records the request and charges the rate limits `cost` tokens: (its record, the
        refusal to answer with (a 429 or a `status` fault) or None, the rate-limit headers)."""
        rec = Record(
            request.headers.get("x-request-id") or uuid.uuid4().hex,
            kind,
            time.monotonic(),
            prompt_tokens=prompt_tokens,
            traceparent=request.headers.get("traceparent"),
        )
        fault = timing.fault
        if fault is not None:
            rec.fault = fault.kind
        self.record(rec)
        if self.full():  # refused before the buckets are charged
            rec.status = 503
            self.finish(rec, "error")
            return rec, _error(503, "The server is overloaded.", code="overloaded"), {}
        wait, rl_headers = self.limits.admit(cost)
        if wait > 0:
            rec.status = 429
            self.finish(rec, "error")
            refusal = _error(
                429,
                "Rate limit reached. Please try again later.",
                code="rate_limit_exceeded",
                headers=retry_headers(wait, rl_headers),
            )
            return rec, refusal, rl_headers
        if fault is not None and fault.kind == "status":
            rec.status = fault.status
            self.finish(rec, "error")
            headers = rl_headers
            if fault.status == 429:
                headers = retry_headers(1.0, rl_headers)
            refusal = _error(fault.status, f"Simulated error {fault.status}.", headers=headers)
            return rec, refusal, rl_headers
        return rec, None, rl_headers

    async def embeddings(self, request: web.Request) -> web.Response:
        """Deterministic vectors (embeddings.py), after the ttft delay, with the rate limits
        and `status` faults of completions."""
        body = await _read_body(request)
        if body is None:
            return _error(413, "Request too large.")
        try:
            req = orjson.loads(body)
            model = req["model"]
            inputs, prompt_text, prompt_tokens = sim_embeddings.inputs(req["input"])
            dims = int(req.get("dimensions") or sim_embeddings.DIMENSIONS)
            fmt = req.get("encoding_format") or "float"
            if fmt not in ("float", "base64") or not 1 <= dims <= sim_embeddings.MAX_DIMENSIONS:
                raise ValueError
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError):
            return _error(400, "Invalid request body.")
        if len(inputs) * dims > sim_embeddings.MAX_VALUES:
            return _error(
                400,
                f"{len(inputs)} inputs of {dims} dimensions is more than the "
                f"{sim_embeddings.MAX_VALUES} numbers the sim answers at once.",
            )
        if not self.config.any_model and model not in self.config.models:
            return _error(404, f"The model `{model}` does not exist.", code="model_not_found")
        try:
            timing = self.timing_for(request, prompt_text)
        except ValueError as e:
            return _error(400, str(e))
        rec, refusal, rl_headers = self._admit(
            request, "embeddings", timing, prompt_tokens, prompt_tokens
        )
        if refusal is not None:
            return refusal
        try:
            if timing.ttft_ms > 0:
                await asyncio.sleep(timing.ttft_ms / 1000)
        except asyncio.CancelledError:
            self.finish(rec, "cancelled")
            raise
        answer = sim_embeddings.body(self.config.seed, model, inputs, dims, fmt, prompt_tokens)
        self.finish(rec, "completed")
        return web.Response(body=answer, content_type="application/json", headers=rl_headers)

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
        req: dict[str, Any],
        call: str | None,
    ) -> web.Response:
        delay = timing.ttft_ms + max(0, len(tokens) - 1) * timing.itl_ms
        if timing.fault is not None and timing.fault.kind in ("stall-first", "stall"):
            delay += timing.fault.ms
        if delay > 0:
            await asyncio.sleep(delay / 1000)
        content = "".join(tokens)
        rec.tokens = len(tokens)
        if kind == "responses":
            self.finish(rec, "completed")
            answer = sim_responses.response_body(
                rec, model, req, content, finish_reason, usage, call
            )
            return web.Response(body=answer, content_type="application/json", headers=headers)
        created = int(time.time())
        cid = "chatcmpl-" + rec.id if kind == "chat" else "cmpl-" + rec.id
        choice: dict[str, Any]
        if kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
            if call is not None:
                function = {"name": call, "arguments": sim_responses.arguments(content.strip())}
                tool = {"id": "call_" + rec.id, "type": "function", "function": function}
                message.update(content=None, tool_calls=[tool])
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
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

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API (messages.py)."""
        body = await _read_body(request)
        if body is None:
            return messages.error(413, "Request too large.")
        return await messages.create(self, request, body)

    async def count_tokens(self, request: web.Request) -> web.Response:
        body = await _read_body(request)
        if body is None:
            return messages.error(413, "Request too large.")
        return await messages.count_tokens(self, body)

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
                    "traceparent": r.traceparent,
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
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        if self.config.responses:
            app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/embeddings", self.embeddings)
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
