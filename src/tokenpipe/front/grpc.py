"""The gRPC front: `tokenpipe.v1.Chat/ChatStream`, many chat requests on one bidirectional stream.

Each request runs in its own task with its own reader, accumulator and flow gate (relay/), so a
request paused by zero credit or a low pace holds up nothing but itself: the others keep writing
to the shared stream. Writes to the stream are serialised by one lock (gRPC allows one writer at a
time); a write waits only when the whole stream's HTTP/2 window is full, i.e. when the client
stops reading altogether.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import msgspec
from google.protobuf.message import DecodeError
from grpc_reflection.v1alpha import reflection

from tokenpipe import answer_fields, request_ids, serving
from tokenpipe import usage as usage_counts
from tokenpipe.control import bodies
from tokenpipe.control.flowgate import FlowGate
from tokenpipe.dialects import Piece
from tokenpipe.dialects import openai_schema as schema
from tokenpipe.errors import GatewayError, dumps_request
from tokenpipe.front.grpc_gen import chat_pb2, chat_pb2_grpc
from tokenpipe.observe import logs, tracing
from tokenpipe.pipeline import Call, Gateway
from tokenpipe.upstream.errors import UpstreamError

log = logging.getLogger("tokenpipe.grpc")

#: Requests open at once on one ChatStream. Past it, the new request gets an Error with status
#: 429 and the stream goes on.
MAX_OPEN_REQUESTS = 256
#: Ids on one ChatStream with flow state but no running request: a FlowControl sent ahead of its
#: ChatRequest, or one that arrived after its request ended (a grant racing the Done). Past it,
#: the least recently touched such id's state is dropped (its request, if it comes, starts with
#: no grant and no pace); nothing is refused. Unbounded but for MAX_OPEN_REQUESTS, ~1.2 KiB an id
#: stayed until the stream ended, and late grants used up the stream's open requests.
MAX_PENDING_FLOWS = 64
#: HTTP/2 streams (calls) open at once on one client connection, gRPC's usual bound: a grpc
#: client queues calls past it until one ends; a stream a client opens past it anyway is reset.
#: Unbounded, one connection's 1,000 streams each kept flow state for 256 ids (310 MiB).
MAX_CONCURRENT_STREAMS = 100
#: Characters of a client's request_id (its own name for a request on the stream).
MAX_REQUEST_ID = 256
#: Characters of an upstream error's message, and of its type and code, passed to a client.
_UPSTREAM_MESSAGE, _UPSTREAM_NAME = 1024, 128
#: Status recorded for a request the client cancelled or abandoned.
CLIENT_CLOSED = 499


class _Request:
    """A running request on a stream: its flow gate and its task."""

    __slots__ = ("changed", "gate", "task")

    def __init__(self, gate: FlowGate) -> None:
        self.gate = gate
        self.changed = asyncio.Event()  # set on every FlowControl for this request
        self.task: asyncio.Task[None] | None = None


class ChatService(chat_pb2_grpc.ChatServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def ChatStream(
        self,
        request_iterator: AsyncIterator[chat_pb2.ClientMessage],
        context: grpc.aio.ServicerContext,
    ) -> None:
        metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        try:
            key = self.gateway.auth.check(metadata.get("authorization"))
        except GatewayError as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, e.message)
            return
        try:
            await _Session(self.gateway, context, key, metadata).run(request_iterator)
        except DecodeError:
            # A client's malformed bytes are its mistake, not ours: INVALID_ARGUMENT, no
            # traceback (the session already cancelled whatever the stream had started).
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Malformed ClientMessage.")


class _Session:
    """One ChatStream call: reads client messages, runs a task per request, writes replies."""

    def __init__(
        self, gateway: Gateway, context: Any, key: str, metadata: dict[str, str] | None = None
    ) -> None:
        self.gateway = gateway
        self.context = context
        self.key = key
        #: The call's metadata: its W3C trace context is the parent of each request's span.
        self.metadata = metadata or {}
        self.requests: dict[str, _Request] = {}
        #: Flow state of ids with no running request, least recently touched first.
        self.pending: dict[str, FlowGate] = {}
        self.write_lock = asyncio.Lock()

    async def send(self, message: chat_pb2.ServerMessage) -> None:
        async with self.write_lock:
            await self.context.write(message)

    async def error(self, request_id: str, e: GatewayError) -> None:
        await self.send(
            chat_pb2.ServerMessage(
                request_id=request_id,
                error=chat_pb2.Error(status=e.status, type=e.type, message=e.message),
            )
        )

    async def run(self, messages: AsyncIterator[chat_pb2.ClientMessage]) -> None:
        try:
            async for msg in messages:
                kind = msg.WhichOneof("kind")
                if kind == "request":
                    await self._start(msg.request)
                elif kind == "flow":
                    await self._flow(msg.flow)
                elif kind == "cancel":
                    rid = msg.cancel.request_id
                    self.pending.pop(rid, None)  # a Cancel takes back a FlowControl sent ahead
                    state = self.requests.get(rid)
                    if state is not None and state.task is not None:
                        state.task.cancel()
            # The client half-closed: the requests it sent still finish.
            tasks = [s.task for s in self.requests.values() if s.task is not None]
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            # The call ended (client gone, deadline, server stop): no request outlives it.
            tasks = [s.task for s in self.requests.values() if s.task and not s.task.done()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _pending_gate(self, request_id: str) -> FlowGate:
        """The flow gate of an id with no running request, now the most recently touched; the
        least recently touched one is dropped past MAX_PENDING_FLOWS."""
        gate = self.pending.pop(request_id, None)
        if gate is None:
            gate = FlowGate()
            if len(self.pending) >= MAX_PENDING_FLOWS:
                del self.pending[next(iter(self.pending))]
        self.pending[request_id] = gate
        return gate

    async def _long_id(self, rid: str) -> bool:
        """An id past MAX_REQUEST_ID is refused (its Error names it cut to the bound): up to
        MAX_OPEN_REQUESTS + MAX_PENDING_FLOWS states are kept by id, and a 4 MB id each was 1 GB
        a stream."""
        if len(rid) <= MAX_REQUEST_ID:
            return False
        why = f"request_id is longer than {MAX_REQUEST_ID} characters."
        await self.error(rid[:MAX_REQUEST_ID], GatewayError(400, why, code="invalid_request_id"))
        return True

    async def _flow(self, flow: chat_pb2.FlowControl) -> None:
        if await self._long_id(flow.request_id):
            return
        state = self.requests.get(flow.request_id)
        gate = state.gate if state is not None else self._pending_gate(flow.request_id)
        if flow.HasField("credit_tokens"):
            gate.grant(flow.credit_tokens)
        if flow.HasField("max_tokens_per_second"):
            gate.set_rate(flow.max_tokens_per_second)
        if state is not None:
            state.changed.set()

    async def _start(self, req: chat_pb2.ChatRequest) -> None:
        rid = req.request_id
        if await self._long_id(rid):
            return
        if rid in self.requests:
            await self.error(
                rid,
                GatewayError(
                    400,
                    f"request_id {rid!r} is already in use on this stream.",
                    code="duplicate_request_id",
                ),
            )
            return
        if len(self.requests) >= MAX_OPEN_REQUESTS:
            await self.error(rid, _too_many())
            return
        # A FlowControl sent ahead applies from the start; its state moves to the request.
        gate = self.pending.pop(rid, None)
        state = self.requests[rid] = _Request(gate if gate is not None else FlowGate())
        state.task = asyncio.create_task(self._serve(rid, req, state))
        # Removed when the request ends (done, failed or cancelled).
        state.task.add_done_callback(lambda _: self._ended(rid, state))

    def _ended(self, rid: str, state: _Request) -> None:
        if self.requests.get(rid) is state:
            del self.requests[rid]

    async def _serve(self, rid: str, req: chat_pb2.ChatRequest, state: _Request) -> None:
        # This request's own task: its log lines carry the id its upstream requests are sent
        # with (the client's request_id names it only within this stream).
        request_id = request_ids.new()
        logs.REQUEST_ID.set(request_id)
        trace = None
        if tracing.TRACER is not None:  # this request's server span (its task's own context)
            trace = tracing.serve(
                self.metadata,
                lambda: (
                    "tokenpipe.v1.Chat/ChatStream",
                    {
                        "rpc.system": "grpc",
                        "rpc.service": "tokenpipe.v1.Chat",
                        "rpc.method": "ChatStream",
                        "tokenpipe.request_id": request_id,
                    },
                ),
            )
            tracing.CURRENT.set(trace)
        status = CLIENT_CLOSED
        held = 0  # the request's charge against the gateway's BodyMemory, while it lasts
        try:
            cost = bodies.estimate_messages(req.ByteSize(), len(req.messages))
            held = self.gateway.bodies.take(cost)
            await self._serve_unguarded(rid, req, state, request_id)
            status = 200
        except GatewayError as e:
            status = e.status
            await self.error(rid, e)
        except asyncio.CancelledError:
            raise
        except Exception:
            status = 500
            log.exception("gRPC request %s failed", rid)
            await self.error(rid, GatewayError(500, "Internal error in the gateway."))
        finally:
            self.gateway.bodies.give(held)
            if trace is not None:
                trace.close(status, http=False)

    async def _serve_unguarded(
        self, rid: str, req: chat_pb2.ChatRequest, state: _Request, request_id: str
    ) -> None:
        started = time.perf_counter()
        if len(req.messages) > schema.MAX_MESSAGES:  # before a dict is made of each (below)
            # msgspec's own words, as for a chat request past it over HTTP. 4 MiB holds 2 M
            # empty messages: their dicts took 0.8 s of the event loop, to be refused.
            raise GatewayError(
                400,
                f"Invalid request: Expected `array` of length <= {schema.MAX_MESSAGES} - at "
                "`$.messages`",
                code="invalid_request",
            )
        obj: dict[str, Any] = {
            "model": req.model,
            "messages": [{"role": m.role, "content": m.content} for m in req.messages],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if req.HasField("max_tokens"):
            obj["max_tokens"] = req.max_tokens
        if req.HasField("temperature"):
            obj["temperature"] = req.temperature
        try:
            creq = msgspec.convert(obj, schema.ChatRequest)
        except msgspec.ValidationError as e:
            raise GatewayError(400, f"Invalid request: {e}", code="invalid_request") from None
        call = await self.gateway.open(
            schema.ChatRequest,
            creq,
            obj,
            dumps_request(obj),
            key=self.key,
            request_id=request_id,
            started=started,
            headers={},
            pace=state.gate.rate or None,  # a pace set before the request: to a generating upstream
        )
        status = CLIENT_CLOSED
        try:
            if call.uresp.status != 200:
                status = call.uresp.status
                await self.error(rid, await _upstream_error(call))
                return
            finish: list[str] = []

            async def emit(pieces: list[Piece]) -> None:
                now = 0.0
                for piece in pieces:
                    if piece.count:
                        now = now or time.perf_counter()
                        call.tally.observe_content(now, piece.count)
                        await self.send(
                            chat_pb2.ServerMessage(
                                request_id=rid,
                                delta=chat_pb2.Delta(content=piece.text, tokens=piece.count),
                            )
                        )
                    if piece.finish_reason:
                        finish.append(piece.finish_reason)
                    if piece.error is not None:
                        finish.append("error")
                        await self.send(
                            chat_pb2.ServerMessage(
                                request_id=rid,
                                error=chat_pb2.Error(
                                    status=502,
                                    type=str(piece.error.get("type") or "upstream_error"),
                                    message=str(piece.error.get("message") or "upstream error"),
                                ),
                            )
                        )

            error = await call.relay(emit, state.gate, state.changed)
            if error is not None:
                status = error.status
                error.message = (
                    f"The stream was cut after {call.tally.deltas} content "
                    f"deltas: {error.message}. The answer is incomplete."
                )
                await self.error(rid, error)
                return
            usage = call.tally.usage
            if usage:
                await self.send(
                    chat_pb2.ServerMessage(
                        request_id=rid,
                        usage=chat_pb2.Usage(
                            # The counts as the upstream sent them (`clean` runs at the
                            # close, later): a string or 1e30 there was a 500.
                            prompt_tokens=usage_counts.count(usage.get("prompt_tokens")),
                            completion_tokens=usage_counts.count(usage.get("completion_tokens")),
                        ),
                    )
                )
            if "error" not in finish:
                await self.send(
                    chat_pb2.ServerMessage(
                        request_id=rid,
                        done=chat_pb2.Done(finish_reason=finish[-1] if finish else "stop"),
                    )
                )
            status = 200
        finally:
            call.close(status)


def _too_many() -> GatewayError:
    return GatewayError(
        429,
        f"More than {MAX_OPEN_REQUESTS} requests open on this stream.",
        code="too_many_open_requests",
    )


async def _upstream_error(call: Call) -> GatewayError:
    uresp = call.uresp
    try:
        _, fields = await call.read_whole(1024 * 1024)
        err = answer_fields.value(fields.error) if fields is not None else None
        if not isinstance(err, dict):
            raise LookupError("no error object")
        # The upstream's words, bounded and as strings (a list as its `type` was a 500).
        kind, code = err.get("type"), err.get("code")
        return GatewayError(
            uresp.status,
            str(err.get("message"))[:_UPSTREAM_MESSAGE],
            type=kind[:_UPSTREAM_NAME] if isinstance(kind, str) else None,
            code=code[:_UPSTREAM_NAME] if isinstance(code, str) else None,
        )
    except (
        TimeoutError,
        UpstreamError,
        LookupError,
    ):
        return GatewayError(
            uresp.status if uresp.status >= 400 else 502,
            f"Upstream answered with status {uresp.status}.",
        )


async def start_server(gateway: Gateway, host: str, port: int) -> grpc.aio.Server:
    max_bytes = gateway.settings.server.max_body_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
            ("grpc.max_send_message_length", 16 * 1024 * 1024),
            # Idle streams are pinged so that dead clients are noticed and their requests freed.
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            # grpcio turns SO_REUSEPORT on by default, so a second gateway on a busy port would
            # start and silently split gRPC clients with the first. On only for
            # `serve --workers`, whose processes share the port by design (limits.workers > 1
            # is set by it: processes sharing one config).
            ("grpc.so_reuseport", 1 if gateway.settings.limits.workers > 1 else 0),
        ]
    )
    chat_pb2_grpc.add_ChatServicer_to_server(ChatService(gateway), server)
    names = (chat_pb2.DESCRIPTOR.services_by_name["Chat"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    serving.announce(f"tokenpipe gRPC listening on {host}:{bound}")
    return server
