"""The Responses API's objects as a translation writes them: the Response (its echo of the
request), its output items (a message, a function call, reasoning) and its usage, from chat's.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

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


#: Deltas an output item keeps apart before it joins them into one run of text.
_RUN = 1024


class OutputItem:
    """One output item: a message, a function call or reasoning.

    Its text (or arguments, or reasoning) comes in deltas, kept as runs of up to _RUN
    deltas joined once each, and joined whole when read (at the item's end). Added to a
    str attribute one by one, it was copied whole by every delta: a 2M-character answer in
    4-character deltas cost 91 s of CPU (benchmarks/hostile_cost.py)."""

    __slots__ = ("_runs", "_tail", "call_id", "id", "index", "kind", "name")

    def __init__(self, kind: str, index: int, item_id: str) -> None:
        self.kind = kind  # message | function_call | reasoning
        self.index = index
        self.id = item_id
        self._runs: list[str] = []  # the text so far: joined runs of deltas, then `_tail`
        self._tail: list[str] = []
        self.call_id = ""
        self.name = ""

    def extend(self, delta: str) -> None:
        tail = self._tail
        tail.append(delta)
        if len(tail) >= _RUN:
            self._runs.append("".join(tail))
            tail.clear()

    @property
    def text(self) -> str:
        """The text, arguments or reasoning so far."""
        runs = self._runs
        if self._tail:
            runs.append("".join(self._tail))
            self._tail.clear()
        if len(runs) > 1:
            runs[:] = ["".join(runs)]
        return runs[0] if runs else ""

    @text.setter
    def text(self, value: str) -> None:
        self._runs, self._tail = [value], []

    def part(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def item(self, status: str) -> dict[str, Any]:
        if self.kind == "function_call":
            return {
                "id": self.id,
                "type": "function_call",
                "status": status,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.text,
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


def response_object(
    request: dict[str, Any],
    response_id: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    model: str | None = None,
    finish: str | None = None,
) -> dict[str, Any]:
    """The Response object in the state `status`, echoing the Responses `request` (checked
    by the translation already)."""
    req = request
    reason = INCOMPLETE.get(finish or "")
    obj: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None,
        "incomplete_details": {"reason": reason} if status == "incomplete" else None,
        "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"),
        "model": model or req.get("model"),
        "output": output,
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
        obj["user"] = req["user"]
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
        items.append(OutputItem("reasoning", len(items), "rs_" + uuid.uuid4().hex))
        items[-1].text = reasoning
    calls = message.get("tool_calls")
    calls = calls if isinstance(calls, list) else []
    text = message.get("content")
    if (isinstance(text, str) and text) or not calls:
        items.append(OutputItem("message", len(items), "msg_" + uuid.uuid4().hex))
        items[-1].text = text if isinstance(text, str) else ""
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        item = OutputItem("function_call", len(items), "fc_" + uuid.uuid4().hex)
        item.call_id = str(call.get("id") or "call_" + uuid.uuid4().hex)
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
