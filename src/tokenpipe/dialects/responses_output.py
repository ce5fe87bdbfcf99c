"""The Responses API's objects as a translation writes them: the Response (its echo of the
request), its output items (a message, a function call, reasoning) and its usage, from chat's.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from tokenpipe import request_ids
from tokenpipe.usage import count

#: Chat finish reasons that make a Response `incomplete`, and the reason it gives.
INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def responses_usage(usage: Any) -> dict[str, Any] | None:
    """A chat `usage` in the Responses shape."""
    if not isinstance(usage, dict):
        return None
    prompt = count(usage.get("prompt_tokens"))  # an upstream's numbers: any JSON at all
    completion = count(usage.get("completion_tokens"))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": _detail(usage, "prompt_tokens_details", "cached_tokens"),
            "cache_write_tokens": 0,  # chat does not say
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": _detail(usage, "completion_tokens_details", "reasoning_tokens")
        },
        "total_tokens": count(usage.get("total_tokens")) or prompt + completion,
    }


def _detail(usage: dict[str, Any], group: str, name: str) -> int:
    details = usage.get(group)
    return count(details.get(name)) if isinstance(details, dict) else 0


#: Bytes of output a translated Responses stream holds for its last events (the items'
#: `*.done` events and `response.completed` each repeat the whole output): its items' text,
#: arguments and reasoning as JSON, their names and call ids, and ITEM_BYTES an item. The
#: bound of one SSE event the gateway reads (sse.SSEDecoder: 4 MiB), so the same as a native
#: Responses stream's, whose `response.completed` carries the whole output in one event.
#: Past it the stream ends with an `error` event (responses_chat.py). Unbounded, 48 MiB of
#: text held 368 MiB of the gateway a stream.
HELD_MAX_BYTES = 4 * 1024 * 1024
#: What an output item costs besides its text: the object, its id, its JSON buffer, its
#: place in the stream's lists (measured: ~360 bytes; an upstream may open one per delta).
ITEM_BYTES = 512


class OutputItem:
    """One output item: a message, a function call or reasoning.

    Its text (or arguments, or reasoning) comes in deltas, kept as one JSON string (escaped
    UTF-8, quotes included) that each delta extends: one object whatever the deltas, its size
    the bytes the end's events copy, which orjson writes as they are (`value`). Added to a
    str attribute one by one, it was copied whole by every delta: a 2M-character answer in
    4-character deltas cost 91 s of CPU (benchmarks/hostile_cost.py)."""

    __slots__ = ("_json", "call_id", "id", "index", "kind", "name")

    def __init__(self, kind: str, index: int, item_id: str) -> None:
        self.kind = kind  # message | function_call | reasoning
        self.index = index
        self.id = item_id
        self._json: bytes | bytearray = b'""'  # the text so far, as a JSON string
        self.call_id = ""
        self.name = ""

    def extend(self, delta: str) -> int:
        """Appends `delta`; returns the bytes it added."""
        return len(self.extend_quoted(delta)) - 2

    def extend_quoted(self, delta: str) -> bytes:
        """Appends `delta`; returns it as a JSON string (its event writes the same bytes)."""
        buf = self._json
        if not isinstance(buf, bytearray):  # set whole (`text`)
            buf = self._json = bytearray(buf)
        quoted = orjson.dumps(delta)
        del buf[-1]  # the closing quote: the delta's own ends the string again
        buf += quoted[1:]
        return quoted

    def size(self) -> int:
        """The bytes it holds: its JSON text, its name, its call id and ITEM_BYTES."""
        return ITEM_BYTES + len(self._json) + len(self.name.encode()) + len(self.call_id.encode())

    def value(self) -> orjson.Fragment:
        """The text as JSON, which orjson writes as it is (not encoded again per event)."""
        buf = self._json
        return orjson.Fragment(buf if type(buf) is bytes else bytes(buf))

    @property
    def text(self) -> str:
        """The text, arguments or reasoning so far."""
        text: str = orjson.loads(self._json)
        return text

    @text.setter
    def text(self, value: str) -> None:
        self._json = orjson.dumps(value)

    def part(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.value()}
        return {"type": "output_text", "text": self.value(), "annotations": [], "logprobs": []}

    def item(self, status: str) -> dict[str, Any]:
        if self.kind == "function_call":
            return {
                "id": self.id,
                "type": "function_call",
                "status": status,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.value(),
            }
        if self.kind == "reasoning":
            content = [self.part()] if status != "in_progress" else []
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content}
        content = [self.part()] if status != "in_progress" else []
        return {
            "id": self.id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }


def request_echo(request: dict[str, Any]) -> dict[str, Any]:
    """The fields of a Response after its output, each an echo of the Responses `request`
    (checked by the translation already): the same in every Response object of a stream,
    so made once a request (a stream writes two: its start's and its end's)."""
    req = request
    echo: dict[str, Any] = {
        "parallel_tool_calls": req.get("parallel_tool_calls") is not False,
        "previous_response_id": None,
        "reasoning": {
            "effort": (req.get("reasoning") or {}).get("effort"),
            "summary": None,
        },
        "store": False,
        "temperature": req.get("temperature"),
        "text": req.get("text") or {"format": {"type": "text"}},
        "tool_choice": req.get("tool_choice") or "auto",
        "tools": [echo_tool(t) for t in req.get("tools") or ()],
        "top_p": req.get("top_p"),
        "truncation": req.get("truncation") or "disabled",
        "metadata": req.get("metadata") or {},
    }
    if req.get("user") is not None:  # (the spec has no null user)
        echo["user"] = req["user"]
    return echo


def response_object(
    request: dict[str, Any],
    echo: dict[str, Any],
    response_id: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    model: str | None = None,
    finish: str | None = None,
) -> dict[str, Any]:
    """The Response object in the state `status`, echoing the Responses `request` (its
    `request_echo`, and two fields more)."""
    obj: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None,
        "incomplete_details": (
            {"reason": INCOMPLETE.get(finish or "")} if status == "incomplete" else None
        ),
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": model or request.get("model"),
        "output": output,
        **echo,
    }
    if usage is not None:
        obj["usage"] = usage
    return obj


def output_of(obj: dict[str, Any]) -> tuple[list[dict[str, Any]], str, str | None]:
    """A chat completion's output items (reasoning, the message, then its tool calls), the
    Response status and the chat finish reason."""
    choices = obj.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    message = choice.get("message") if isinstance(choice, dict) else None
    message = message if isinstance(message, dict) else {}
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    status = "incomplete" if finish in INCOMPLETE else "completed"
    items: list[OutputItem] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        items.append(OutputItem("reasoning", len(items), "rs_" + request_ids.new()))
        items[-1].text = reasoning
    calls = message.get("tool_calls")
    calls = calls if isinstance(calls, list) else []
    text = message.get("content")
    if (isinstance(text, str) and text) or not calls:
        items.append(OutputItem("message", len(items), "msg_" + request_ids.new()))
        items[-1].text = text if isinstance(text, str) else ""
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        item = OutputItem("function_call", len(items), "fc_" + request_ids.new())
        item.call_id = str(call.get("id") or "call_" + request_ids.new())
        item.name = str(function.get("name") or "")
        item.text = str(function.get("arguments") or "")
        items.append(item)
    return [i.item(status) for i in items], status, finish


def echo_tool(tool: Any) -> Any:
    """A request's function tool as a Response lists it (with `strict` and `parameters`,
    null when the request left them out)."""
    if isinstance(tool, dict) and tool.get("type") == "function":
        return {"strict": None, "parameters": None, **tool}
    return tool


def error_event_of(error: dict[str, Any]) -> dict[str, Any]:
    """A chat upstream's error object as a Responses `error` event (its number to come)."""
    code = error.get("code")
    return {
        "type": "error",
        "code": code if isinstance(code, str) else error.get("type"),
        "message": str(error.get("message") or "upstream error"),
        "param": error.get("param") if isinstance(error.get("param"), str) else None,
    }
