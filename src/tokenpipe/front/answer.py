"""The answer of an upstream call, as the HTTP front gives it to the client: a non-streamed
body (or an upstream error) passed through as sent, or the stream relayed as SSE, with an
error after the first byte as the stream's last event."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tokenpipe import answer_fields, sse
from tokenpipe.control.flowgate import FlowGate
from tokenpipe.dialects import Dialect
from tokenpipe.errors import GatewayError
from tokenpipe.front.edge import CLIENT_CLOSED, SSE_HEADERS, Arrival, bound_client_buffers
from tokenpipe.front.sse_out import StreamEnd, emit_sse
from tokenpipe.front.wire import Request, Response, StreamResponse, json_response
from tokenpipe.observe.server_timing import ENGINE_HEADERS
from tokenpipe.pipeline import Call
from tokenpipe.relay.tally import StreamTally
from tokenpipe.upstream.errors import UpstreamError, UpstreamProtocolError
from tokenpipe.upstream.http import PROTOCOL_ERROR

log = logging.getLogger("tokenpipe.front")

#: Server-side phases (ms) a generating upstream reports on non-streamed answers
#: (`tokenpipe local`); passed through as they are (and in Server-Timing, checked). Streams
#: carry them as an SSE comment, relayed as it came.
_ENGINE_TIMING_HEADERS = tuple(name for name, _ in ENGINE_HEADERS)
#: The upstream's rate-limit headers passed on with its error (OpenAI's, Anthropic's).
_RATELIMIT_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-")

#: Largest 200 answer a translation reads (bytes); a larger one is a 502
#: `upstream_response_too_large`. A translation parses the answer whole, every value a Python
#: object: 4 MiB of `[]`s cost 0.28 s of CPU and +122 MiB (at the 64 MiB cap of the answers
#: passed on: 5 s and 1.7 GiB). 4 MiB is what a translated stream holds at most
#: (responses_output.HELD_MAX_BYTES), ~8x a 128k-token answer.
TRANSLATED_MAX_BYTES = 4 * 1024 * 1024
#: Of a 200 answer passed on as sent (`Dialect.answers_as_sent`) the gateway reads only
#: `usage` (the dialect's `usage_of`); of an error answer, every dialect reads only `error`
#: (`upstream_error_body`): answer_fields, without parsing the rest. A translation's 200
#: answer is read for the fields it translates (`Dialect.parse_answer`, event_json.py).


async def unary(call: Call, rid: str) -> tuple[int, Response]:
    """A non-streamed answer, or an upstream error before streaming: passed through as sent
    (a translation's 200 answer: translated)."""
    uresp, tally, dialect = call.uresp, call.tally, call.dialect
    status = uresp.status
    whole = status == 200 and not dialect.answers_as_sent  # a translation
    try:
        body, fields = await call.read_whole(TRANSLATED_MAX_BYTES if whole else None)
    except UpstreamProtocolError as e:  # bad chunk framing and the like
        raise GatewayError(502, f"Upstream broke the protocol: {e}.", code=PROTOCOL_ERROR) from None
    except (TimeoutError, UpstreamError):
        raise GatewayError(
            502, "Upstream closed the connection before answering.", code="upstream_error"
        ) from None
    headers = {"x-request-id": rid}
    try:
        obj = dialect.parse_answer(body) if whole else _read(fields)
    except sse.SSEProtocolError as e:  # too large to read in another shape than its API's
        raise GatewayError(502, f"Upstream broke the protocol: {e}.", code=PROTOCOL_ERROR) from None
    if status == 200:
        if not isinstance(obj, dict):
            raise GatewayError(
                502, "Upstream sent a response that is not a JSON object.", code=PROTOCOL_ERROR
            )
        try:
            tally.usage = dialect.usage_of(obj)
            if whole:
                body = dialect.answer(body, obj)
        except sse.SHAPE_ERRORS as e:  # `"choices": 5`, `"content": 5`... (see sse.py)
            raise GatewayError(
                502, f"Upstream broke the protocol: {sse.shape_error(e)}.", code=PROTOCOL_ERROR
            ) from None
        for name in _ENGINE_TIMING_HEADERS:  # the engine's own phases, for doctor and benches
            value = uresp.headers.get(name)
            if value is not None:
                headers[name] = value
        headers["Server-Timing"] = call.timing.header(time.perf_counter(), uresp.headers)
        return status, json_response(status, body, headers)
    # Upstream error: keep its status when it is an HTTP error a client can act on, make sure
    # the body is an error of the client's API (OpenAI's and Anthropic's both hold an "error"
    # object), and keep the rate-limit headers a client's retry logic reads.
    for name, value in uresp.headers.items():
        lname = name.lower()
        if lname.startswith(_RATELIMIT_PREFIXES) or lname in ("retry-after", "retry-after-ms"):
            headers[name] = value
    if status < 400 or status > 599:
        status = 502
    translated = dialect.upstream_error_body(status, obj)
    if translated is not None:
        body = translated
    elif not (isinstance(obj, dict) and isinstance(obj.get("error"), dict)):
        body = dialect.error_body(
            GatewayError(
                status, f"Upstream answered with status {uresp.status}.", code="upstream_error"
            )
        )
    if status == 429 and "Retry-After" not in uresp.headers:
        headers.update(GatewayError(429, "").headers)
    headers["Server-Timing"] = call.timing.header(time.perf_counter())
    return status, json_response(status, body, headers)


def _read(fields: answer_fields.Fields | None) -> dict[str, Any] | None:
    """The `usage` and `error` of an answer that is a JSON object (else None)."""
    if fields is None:
        return None
    return {"usage": answer_fields.value(fields.usage), "error": answer_fields.value(fields.error)}


async def serve(
    request: Request,
    arrival: Arrival,
    kind: type[Any],
    req: Any,
    obj: dict[str, Any],
    *,
    stream: bool = False,
    gate: FlowGate | None = None,
    dialect: Dialect | None = None,
    body: bytes | None = None,
) -> Response | StreamResponse:
    """The rest of every API route once it parsed the request: the call opened through the
    pipeline (`body`: the bytes to send, if not the client's) and answered (`respond`)."""
    call = await arrival.gateway.open(
        kind,
        req,
        obj,
        arrival.body if body is None else body,
        key=arrival.key,
        request_id=arrival.rid,
        started=arrival.started,
        headers=request.headers,
        scope=arrival.scope,
        pace=gate.rate if gate is not None else None,  # sent upstream (upstream/http.py)
        dialect=dialect,
        timing=request.timing,
    )
    return await respond(request, call, arrival.rid, stream, gate)


async def respond(
    request: Request, call: Call, rid: str, stream: bool, gate: FlowGate | None
) -> Response | StreamResponse:
    """The client's answer to an opened call: the unary body, an upstream error, or the
    stream relayed as SSE. Closes the call whatever happens."""
    status = CLIENT_CLOSED
    try:
        if call.uresp.status != 200 or not stream:
            status, response = await unary(call, rid)
            response.headers.update(call.ctx.headers)
            return response
        sse_response = StreamResponse(
            status=200,
            headers={
                **SSE_HEADERS,
                "x-request-id": rid,
                "Server-Timing": call.timing.header(),  # the phases so far; the rest at the end
                **call.ctx.headers,
            },
        )
        bound_client_buffers(request, request.app.gateway.settings.server.stream_send_buffer_bytes)
        await sse_response.prepare(request)
        # A shutdown cut ends it with an error event of its API.
        request.sse = sse_response
        request.error_event = call.dialect.error_event
        status = await relay_sse(call, sse_response, gate, request.task)
        return sse_response
    finally:
        call.close(status)


async def relay_sse(
    call: Call,
    response: StreamResponse,
    gate: FlowGate | None,
    task: asyncio.Task[Any] | None,
) -> int:
    """Returns the status to record. Errors after the first byte become an SSE error event.
    `task`: the one running it (the request's; None: looked up)."""
    tally = call.tally
    end = StreamEnd(tally, call.timing)
    emit, write_now, ready = emit_sse(response, tally, end)
    try:
        error = await call.relay(emit, gate, write_now=write_now, ready=ready, task=task)
        # An error event is the stream's last: no [DONE] follows it (ARCHITECTURE.md), so a
        # client that stops at [DONE] never takes a cut answer for a whole one. The same holds
        # when the stream ended at the upstream's own error event (relayed as it came).
        if error is not None and not response.ended:  # (ended: its own last event went out)
            error.message = _cut_message(tally, error.message)
            await response.write(end() + call.dialect.error_event(error))
    except ConnectionResetError:  # the client went away (a write, or the wait to write)
        return CLIENT_CLOSED
    except Exception:
        # A bug of ours mid-stream: the client still gets an error event and the end of the
        # stream, not a response that never ends (the middleware cannot answer any more).
        log.exception("internal error while streaming")
        error = GatewayError(500, _cut_message(tally, "internal error in the gateway"))
        if not response.ended:
            await response.write(end() + call.dialect.error_event(error))
    await response.write_eof()
    return 200 if error is None else error.status


def _cut_message(tally: StreamTally, why: str) -> str:
    return (
        f"The stream was cut after {tally.deltas} content deltas: {why}. The answer is incomplete."
    )
