"""The sim's Responses API (`POST /v1/responses`): the same words, timing and faults as its
chat completions, as Responses events (streamed) or a Response object (not streamed), with
the sequence numbers, output items and usage OpenAI writes. A request that forces a function
tool (`tool_choice` "required" or naming one) gets a call of it whose arguments are
`{"words": "<the words>"}`, as the sim's chat completions do."""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from tokenpipe.engines.sim.records import Record
from tokenpipe.engines.sim.stream import ARGS_OPEN

_EVENT = b"event: "


def prompt_of(req: dict[str, Any]) -> tuple[str, int]:
    """The prompt text of a Responses request (what the words continue, where directives
    are read) and its tokens as the sim counts them. Raises TypeError/KeyError when broken."""
    tools = req.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise TypeError("tools")  # echoed in the response object: a 400 now, not a 500 there
    texts = [req["instructions"]] if isinstance(req.get("instructions"), str) else []
    source = req["input"]
    items = [{"content": source}] if isinstance(source, str) else list(source)
    for item in items:
        if not isinstance(item, dict):
            raise TypeError("input")
        value = item.get("content", item.get("output", item.get("arguments", "")))
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):
            texts.extend(p.get("text", "") for p in value if isinstance(p, dict))
    text = " ".join(texts)
    return text, len(text.split()) + 4 * len(items) + 3


def forced_call(req: dict[str, Any]) -> str | None:
    """The function a request forces (chat's or the Responses API's tool shapes), if any."""
    choice = req.get("tool_choice")
    tools = req.get("tools")
    if isinstance(choice, dict):
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        return name if isinstance(name, str) else None
    if choice == "required" and isinstance(tools, list) and tools and isinstance(tools[0], dict):
        name = tools[0].get("name") or (tools[0].get("function") or {}).get("name")
        return name if isinstance(name, str) else None
    return None


def arguments(words: str) -> str:
    return orjson.dumps({"words": words}).decode()


def _usage(usage: dict[str, int]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


class _Shape:
    """The ids and the echoed request fields one answer shares."""

    def __init__(self, rec: Record, model: str, req: dict[str, Any], call: str | None) -> None:
        self.req = req
        self.model = model
        # Unique per answer, as a real server's are (not the request's id: a hedge of the
        # same request is another response).
        unique = uuid.uuid4().hex
        self.id = "resp_" + unique
        self.item_id = ("fc_" if call else "msg_") + unique
        self.call = call
        self.created = int(time.time())

    def item(self, text: str, status: str) -> dict[str, Any]:
        if self.call is not None:
            return {
                "id": self.item_id,
                "type": "function_call",
                "status": status,
                "call_id": "call_" + self.item_id[3:],
                "name": self.call,
                "arguments": text,
            }
        content = [] if status == "in_progress" else [_part(text)]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, int] | None
    ) -> dict[str, Any]:
        req = self.req
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": req.get("instructions"),
            "max_output_tokens": req.get("max_output_tokens"),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": req.get("temperature", 1.0),
            "text": {"format": {"type": "text"}},
            "tool_choice": req.get("tool_choice", "auto"),
            "tools": [{"strict": None, "parameters": None, **t} for t in req.get("tools") or ()],
            "top_p": req.get("top_p", 1.0),
            "truncation": "disabled",
            "metadata": req.get("metadata") or {},
        }
        if usage is not None:
            obj["usage"] = _usage(usage)
        return obj


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_body(
    rec: Record,
    model: str,
    req: dict[str, Any],
    text: str,
    finish_reason: str,
    usage: dict[str, int],
    call: str | None,
) -> bytes:
    """The non-streamed Response."""
    shape = _Shape(rec, model, req, call)
    status = "incomplete" if finish_reason == "length" else "completed"
    body = arguments(text.strip()) if call else text
    return orjson.dumps(shape.response(status, [shape.item(body, status)], usage))


class ResponsesFrames:
    """The streamed Response (stream.Frames): its events, numbered in order."""

    def __init__(
        self,
        rec: Record,
        model: str,
        req: dict[str, Any],
        finish_reason: str,
        usage: dict[str, int],
        call: str | None,
    ) -> None:
        self.shape = _Shape(rec, model, req, call)
        self.finish_reason = finish_reason
        self.usage = usage
        self.seq = 0
        self.text: list[str] = []
        where = {"item_id": self.shape.item_id, "output_index": 0}
        if call is None:
            self._delta = {"type": "response.output_text.delta", **where, "content_index": 0}
            self._delta["logprobs"] = []
        else:
            self._delta = {"type": "response.function_call_arguments.delta", **where}
        self.where = where

    def _event(self, obj: dict[str, Any]) -> bytes:
        obj["sequence_number"] = self.seq
        self.seq += 1
        return _EVENT + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"

    def opening(self) -> bytes:
        shape = self.shape
        snapshot = shape.response("in_progress", [], None)
        out = [
            self._event({"type": "response.created", "response": snapshot}),
            self._event({"type": "response.in_progress", "response": snapshot}),
            self._event(
                {
                    "type": "response.output_item.added",
                    "output_index": 0,
                    "item": shape.item("", "in_progress"),
                }
            ),
        ]
        if shape.call is None:
            added = {"type": "response.content_part.added", **self.where, "content_index": 0}
            out.append(self._event({**added, "part": _part("")}))
        return b"".join(out)

    def _piece(self, text: str) -> bytes:
        self.text.append(text)
        return self._event({**self._delta, "delta": text})

    def delta(self, text: str) -> bytes:
        if self.shape.call is not None and not self.text:
            text = ARGS_OPEN + text.lstrip()  # the words, without their leading space
        return self._piece(text)

    def closing(self) -> bytes:
        shape = self.shape
        status = "incomplete" if self.finish_reason == "length" else "completed"
        out = []
        if shape.call is None:
            text = "".join(self.text)
            where = {**self.where, "content_index": 0}
            out.append(
                self._event(
                    {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
                )
            )
            out.append(
                self._event({"type": "response.content_part.done", **where, "part": _part(text)})
            )
        else:
            out.append(self._piece(("" if self.text else ARGS_OPEN) + '"}'))
            text = "".join(self.text)
            done = {"type": "response.function_call_arguments.done", **self.where}
            out.append(self._event({**done, "name": shape.call, "arguments": text}))
        item = shape.item(text, status)
        out.append(
            self._event({"type": "response.output_item.done", "output_index": 0, "item": item})
        )
        response = shape.response(status, [item], self.usage)
        out.append(self._event({"type": f"response.{status}", "response": response}))
        return b"".join(out)
