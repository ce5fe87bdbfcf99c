"""A Responses API client served by a chat completions upstream: the upstream's chat chunks
become Responses events, its chat completion a Response object.

`ResponsesViaChat` is the request's dialect (one per request): toward the upstream it is chat
(path, usage, continuation), toward the client Responses (`answer`, `error_event`). Its own
`read` is chat's, without state, because the router also reads the first events of hedges and
retries with it; the relayed stream is read by its `for_stream()`, a `_Translation` holding the
stream's state: the output items opened so far and the next sequence number.

The stream, as OpenAI writes it: `response.created`, `response.in_progress`, then per output
item `response.output_item.added` (a message: `response.content_part.added`, the
`response.output_text.delta` events; a function call: `response.function_call_arguments.delta`
events; reasoning: `response.reasoning_text.delta` events), at the chat finish each item's
`*.done` events in order, and at `[DONE]` `response.completed` (`response.incomplete` after a
`length` or `content_filter` finish) with the usage and the whole output. The first two go
out with the first event that carries anything (a role-only chunk carries nothing), so a
hedge's or a retry's events can take over before content without the client seeing two starts.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from tokenpipe import request_ids, sse
from tokenpipe.dialects.base import Dialect, Piece
from tokenpipe.dialects.chat_upstream import lone_text, read_chunk, read_completion
from tokenpipe.dialects.openai import CHAT, ChatDialect
from tokenpipe.dialects.responses import (
    TEXT_DELTA,
    encode_event,
    error_payload,
    render_text_delta,
)
from tokenpipe.dialects.responses_output import (
    HELD_MAX_BYTES,
    INCOMPLETE,
    OutputItem,
    error_event_of,
    output_of,
    request_echo,
    response_object,
    responses_usage,
)
from tokenpipe.errors import GatewayError


class ResponsesViaChat(ChatDialect):
    name = "responses"
    answers_as_sent = False

    def __init__(self, request: dict[str, Any]) -> None:
        #: The client's Responses request: what the Response object echoes.
        self.request = request
        self.echo: dict[str, Any] | None = None  # its fields every Response repeats
        # Ids of this response and its items: unique, not secret (request_ids: ~0.7 us an id,
        # uuid4's ~5 us; a 1-token answer takes two).
        self.id = "resp_" + request_ids.new()
        self.created = int(time.time())
        self.stream = _Translation(self)

    def read(
        self, data: bytes, event: str | None, raw: bytes | None, strip_usage: bool
    ) -> Piece | None:
        return CHAT.read(data, event, raw, strip_usage)

    def for_stream(self) -> Dialect:
        return self.stream

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        model: str | None = None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        """The Response object in the state `status`."""
        echo = self.echo
        if echo is None:
            echo = self.echo = request_echo(self.request)
        return response_object(
            self.request, echo, self.id, self.created, status, output, usage, model, finish
        )

    def parse_answer(self, body: bytes) -> Any:
        return read_completion(body)

    def answer(self, body: bytes, obj: dict[str, Any]) -> bytes:
        """A chat completion as a Response."""
        output, status, finish = output_of(obj)
        model = obj.get("model")
        usage = responses_usage(obj.get("usage"))
        model = model if isinstance(model, str) else None
        return orjson.dumps(self.response(status, output, usage, model, finish))

    def error_event(self, error: GatewayError) -> bytes:
        out: list[bytes] = []
        self.stream.add(out, error_payload(error, 0))
        return b"".join(out)


class _Translation(Dialect):
    """The relayed stream's reader: chat chunks in, Responses events out (see the module)."""

    name = "responses"
    path = "/chat/completions"

    def __init__(self, owner: ResponsesViaChat) -> None:
        self.owner = owner
        self.seq = 0  # the next event's sequence_number
        self.items: list[OutputItem] = []
        self.message: OutputItem | None = None
        self.reasoning: OutputItem | None = None
        self.calls: dict[int, OutputItem] = {}  # chat tool call index -> its item
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None
        self.closed = False  # the items' done events were written
        self.held = 0  # bytes the items hold (OutputItem.size), at most HELD_MAX_BYTES
        #: The message's text delta event up to its text, and from after the text up to its
        #: number (`_text`), cut when the message opens.
        self.delta_head = self.delta_seq = b""

    def add(self, out: list[bytes], obj: dict[str, Any]) -> dict[str, Any]:
        """Appends the event `obj` with the next sequence number (after the response's two
        opening events, if this is the stream's first)."""
        if self.seq == 0 and obj["type"] != "response.created":
            # Its JSON made once for both events (orjson writes a Fragment as it is).
            snapshot = orjson.Fragment(
                orjson.dumps(self.owner.response("in_progress", [], model=self.model))
            )
            self.add(out, {"type": "response.created", "response": snapshot})
            self.add(out, {"type": "response.in_progress", "response": snapshot})
        obj["sequence_number"] = self.seq
        self.seq += 1
        out.append(encode_event(obj))
        return obj

    def read(
        self, data: bytes, event: str | None, raw: bytes | None, strip_usage: bool
    ) -> Piece | None:
        seq = self.seq
        try:
            if data == sse.DONE:
                return self._end()
            obj = read_chunk(data)
            # The usual chunk, one text delta while the message is open: its event at once,
            # without the general path's tests (~0.4 us of a token's ~2.6).
            message = self.message
            if (
                message is not None
                and not self.closed
                and self.model is not None
                and (text := lone_text(obj)) is not None
            ):
                piece = Piece(self._delta(message, text), [text])
                piece.may_merge, piece.kind, piece.dialect = True, "text", self
                return piece
            return self._general(obj)
        except Exception:
            # The events of this read are not sent: the error event the relay writes next
            # takes the number after the last one the client got.
            self.seq = seq
            raise

    def _general(self, obj: dict[str, Any]) -> Piece | None:
        """A chunk of any other shape than the usual (`read`): the events of each of its
        parts, its usage and finish."""
        choices = obj.get("choices")
        if self.model is None and isinstance(obj.get("model"), str):
            self.model = obj["model"]
        usage = obj.get("usage")
        usage = usage if isinstance(usage, dict) and usage else None
        if usage is not None:
            self.usage = usage
        out: list[bytes] = []
        if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
            error = obj.get("error")
            if isinstance(error, dict):  # the upstream's own error event ends the stream
                self.add(out, error_event_of(error))
                piece = Piece(b"".join(out))
                piece.error, piece.end, piece.usage = error, True, usage
                return piece
            return _facts(usage)
        choice = choices[0]
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        merges = False
        texts: list[str] = []
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            self._reasoning(out, reasoning)
            texts.append("")
        content = delta.get("content")
        if isinstance(content, str) and content:
            # A plain delta (its event alone in the piece) merges with its neighbours.
            merges = not out
            self._text(out, content)
            texts.append(content)
            merges = merges and len(out) == 1
        calls = delta.get("tool_calls")
        if isinstance(calls, list) and calls:
            for n, call in enumerate(calls):
                if isinstance(call, dict):
                    self._call(out, call, n)
            texts.append("")
            merges = False
        finish = choice.get("finish_reason")
        if isinstance(finish, str) and finish:
            self.finish = finish
            self._close(out)
            merges = False
        if not out:
            return _facts(usage)
        if merges:  # (parsed into its template only if it does merge: `template`)
            piece = Piece(out[0], texts)
            piece.may_merge, piece.kind, piece.dialect = True, "text", self
        else:
            piece = Piece(b"".join(out), ["".join(texts)] if texts else None)
        piece.usage = usage
        if finish:
            piece.finish_reason = finish
        return piece

    def template(self, raw: bytes) -> tuple[Any, str] | None:
        """A text delta event this translation wrote (`_text`), parsed for merging."""
        return orjson.loads(raw[raw.find(b"data: ") + 6 : -2]), "text"

    def render(self, template: Any, kind: str, text: str) -> bytes:
        return render_text_delta(template, text)

    def _hold(self, size: int) -> None:
        """Counts `size` more bytes held for the end's events. Past HELD_MAX_BYTES the stream
        ends: a protocol error, so the client gets the events before this read, then the
        `error` event, and never a `response.completed` without the rest of its output."""
        self.held += size
        if self.held > HELD_MAX_BYTES:
            raise sse.SSEProtocolError(
                f"the answer passed {HELD_MAX_BYTES} bytes, the most a Responses stream "
                "translated from chat holds for its last events"
            )

    def _open(self, out: list[bytes], kind: str, prefix: str) -> OutputItem:
        item = OutputItem(kind, len(self.items), prefix + request_ids.new())
        self._hold(item.size())
        self.items.append(item)
        added = {"type": "response.output_item.added", "output_index": item.index}
        self.add(out, {**added, "item": item.item("in_progress")})
        if kind != "function_call":
            part = {"type": "response.content_part.added", **self._where(item)}
            self.add(out, {**part, "part": item.part()})
        return item

    def _where(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.index, "content_index": 0}

    def _text(self, out: list[bytes], text: str) -> None:
        """A text delta's event, after the message's opening events if it opens here."""
        item = self.message
        if item is None:
            item = self.message = self._open(out, "message", "msg_")
            # The event's bytes for an empty text, numbered 0, cut around the text and the
            # number: what orjson writes for its dict, with the text and number to go in.
            empty = {"type": TEXT_DELTA, **self._where(item), "delta": "", "logprobs": []}
            event = encode_event({**empty, "sequence_number": 0})
            text_at = event.rindex(b'"delta":""') + 8
            self.delta_head = event[:text_at]
            self.delta_seq = event[text_at + 2 : -4]  # up to the number (`0}\n\n` ends it)
        out.append(self._delta(item, text))

    def _delta(self, item: OutputItem, text: str) -> bytes:
        """The open message's text delta event, written from its bytes cut when the message
        opened (`_text`) and the text's JSON, which the message keeps anyway (a dict built and
        serialised cost ~1.3 us of a translated token's ~3.4)."""
        quoted = item.extend_quoted(text)
        self._hold(len(quoted) - 2)
        seq = self.seq  # (> 0: the message's opening events went before)
        self.seq = seq + 1
        return self.delta_head + quoted + self.delta_seq + str(seq).encode() + b"}\n\n"

    def _reasoning(self, out: list[bytes], text: str) -> None:
        if self.reasoning is None:
            self.reasoning = self._open(out, "reasoning", "rs_")
        self._hold(self.reasoning.extend(text))
        event = {"type": "response.reasoning_text.delta", **self._where(self.reasoning)}
        self.add(out, {**event, "delta": text})

    def _call(self, out: list[bytes], call: dict[str, Any], n: int) -> None:
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        key = call.get("index")
        key = key if type(key) is int else n  # (an upstream's value: any JSON)
        item = self.calls.get(key)
        if item is None:
            item = OutputItem("function_call", len(self.items), "fc_" + request_ids.new())
            item.call_id = str(call.get("id") or "call_" + request_ids.new())
            item.name = str(function.get("name") or "")
            self._hold(item.size())
            self.items.append(item)
            self.calls[key] = item
            added = {"type": "response.output_item.added", "output_index": item.index}
            self.add(out, {**added, "item": item.item("in_progress")})
        args = function.get("arguments")
        if isinstance(args, str) and args:
            self._hold(item.extend(args))
            self.add(
                out,
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item.id,
                    "output_index": item.index,
                    "delta": args,
                },
            )

    def _status(self) -> str:
        return "incomplete" if self.finish in INCOMPLETE else "completed"

    def _close(self, out: list[bytes]) -> None:
        """Each open item's done events, in the order they were opened."""
        if self.closed:
            return
        self.closed = True
        status = self._status()
        for item in self.items:
            where = self._where(item)
            if item.kind == "function_call":
                self.add(
                    out,
                    {
                        "type": "response.function_call_arguments.done",
                        "item_id": item.id,
                        "output_index": item.index,
                        "name": item.name,
                        "arguments": item.value(),
                    },
                )
            else:
                done = "response.output_text.done"
                extra: dict[str, Any] = {"logprobs": []}
                if item.kind == "reasoning":
                    done, extra = "response.reasoning_text.done", {}
                self.add(out, {"type": done, **where, "text": item.value(), **extra})
                self.add(out, {"type": "response.content_part.done", **where, "part": item.part()})
            done_item = {"type": "response.output_item.done", "output_index": item.index}
            self.add(out, {**done_item, "item": item.item(status)})

    def _end(self) -> Piece:
        """`[DONE]`: the response's last event, with the usage and the whole output."""
        out: list[bytes] = []
        self._close(out)
        status = self._status()
        response = self.owner.response(
            status,
            [i.item(status) for i in self.items],
            responses_usage(self.usage),
            self.model,
            self.finish,
        )
        self.add(out, {"type": f"response.{status}", "response": response})
        piece = Piece(b"".join(out))
        piece.end = True
        piece.usage = self.usage
        piece.finish_reason = self.finish or "stop"
        return piece


def _facts(usage: dict[str, Any] | None) -> Piece | None:
    """A chunk with nothing for the client (a role chunk, a usage chunk): its usage only."""
    if usage is None:
        return None
    piece = Piece(None)
    piece.usage = usage
    piece.hidden = True
    return piece
