"""A chat completion request written as an Anthropic Messages request (see
chat_via_messages.py): what both APIs express is translated, what Messages cannot express is
a 400 naming the field."""

from __future__ import annotations

from typing import Any

import orjson

from tokenpipe.errors import GatewayError

#: `max_tokens` sent when the chat request sets none (Anthropic requires it; tokens).
DEFAULT_MAX_TOKENS = 4096


#: Chat fields Anthropic's Messages API has no counterpart for: refused, naming the field.
UNSUPPORTED = (
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
)

_UNSUPPORTED = frozenset(UNSUPPORTED)


#: Chat's string tool choices as Anthropic's.
_CHOICE = {"auto": {"type": "auto"}, "none": {"type": "none"}, "required": {"type": "any"}}


def _bad(field: str, why: str) -> GatewayError:
    return GatewayError(
        400,
        f"`{field}` {why}: the model's upstream speaks Anthropic's Messages API, which cannot "
        "express it.",
        param=field,
        code="invalid_request",
    )


def _mistyped(field: str, what: str) -> GatewayError:
    """A field this translation reads (the front's schema types only what every route reads)
    that does not have the shape chat's API gives it."""
    return GatewayError(400, f"`{field}` must be {what}.", param=field, code="invalid_request")


def _objects(value: Any, field: str) -> list[dict[str, Any]]:
    """`value` as a list of JSON objects (absent: none), else a 400 naming `field`."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise _mistyped(field, "a list of objects")
    return value


def _object(value: Any, field: str) -> dict[str, Any]:
    """`value` as a JSON object (absent: an empty one), else a 400 naming `field`."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _mistyped(field, "an object")
    return value


def _image(part: dict[str, Any]) -> dict[str, Any]:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else None
    if not isinstance(url, str):
        raise _bad("messages", "has an image_url part without a url")
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        media = head[5:].split(";", 1)[0]
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _blocks(content: Any, field: str = "messages") -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if not isinstance(content, list):
        return []
    out: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append({"type": "text", "text": str(part.get("text") or "")})
        elif kind == "image_url":
            out.append(_image(part))
        else:
            raise _bad(field, f"has a content part of type {kind!r}")
    return out


def _text_of(content: Any) -> str:
    return "".join(b["text"] for b in _blocks(content) if b["type"] == "text")


def _arguments(raw: Any) -> Any:
    if not isinstance(raw, str) or not raw:
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _bad("messages", "has a tool call whose arguments are not JSON") from None


def messages_request(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion request as a Messages request (400 for what it cannot express)."""
    if not _UNSUPPORTED.isdisjoint(chat):  # (one C call for the usual request)
        for field in UNSUPPORTED:
            if chat.get(field) not in (None, False):
                raise _bad(field, "is set")
    if chat.get("n") not in (None, 1):
        raise _bad("n", "asks for more than one choice")
    fmt = chat.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise _bad("response_format", "asks for structured output")
    system: list[str] = []
    messages: list[dict[str, Any]] = []
    # The last message's blocks while they are a user turn of tool results only: results
    # join it without looking at it again (looked at per result, 10,000 tool messages,
    # the schema's bound, cost 2 s of CPU: benchmarks/hostile_cost.py).
    results: list[dict[str, Any]] | None = None
    for i, m in enumerate(chat.get("messages") or ()):
        role = m.get("role")
        if role in ("system", "developer"):
            system.append(_text_of(m.get("content")))
        elif role == "user":
            messages.append({"role": "user", "content": _blocks(m.get("content"))})
        elif role == "assistant":
            blocks = _blocks(m.get("content"))
            calls = m.get("tool_calls")
            if calls is not None:  # (its name written only then: a client resends them all)
                at = f"messages[{i}].tool_calls"
                for j, call in enumerate(_objects(calls, at)):
                    fn = _object(call.get("function"), f"{at}[{j}].function")
                    blocks.append(
                        {
                            "type": "tool_use",
                            "id": call.get("id"),
                            "name": fn.get("name"),
                            "input": _arguments(fn.get("arguments")),
                        }
                    )
            messages.append({"role": "assistant", "content": blocks})
        elif role == "tool":
            result = {
                "type": "tool_result",
                "tool_use_id": m.get("tool_call_id"),
                "content": _text_of(m.get("content")),
            }
            last = messages[-1] if messages else None
            if last is not None and last["content"] is not results:
                results = None  # another message came since: look at it, once
                if last["role"] == "user" and all(
                    b.get("type") == "tool_result" for b in last["content"]
                ):
                    results = last["content"]
            if results is not None:
                results.append(result)  # one user turn holds all results of a turn
            else:
                results = [result]
                messages.append({"role": "user", "content": results})
        else:
            raise _bad("messages", f"has a message with role {role!r}")
    out: dict[str, Any] = {
        "model": chat.get("model"),
        "messages": messages,
        "max_tokens": chat.get("max_completion_tokens")
        or chat.get("max_tokens")
        or DEFAULT_MAX_TOKENS,
    }
    if system:
        out["system"] = "\n\n".join(s for s in system if s)
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("stream", "stream")):
        if chat.get(src) is not None:
            out[dst] = chat[src]
    stop = chat.get("stop")
    if stop:
        if isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _mistyped("stop", "a string or a list of strings")
        out["stop_sequences"] = stop
    if chat.get("user"):
        out["metadata"] = {"user_id": str(chat["user"])}
    tools = _objects(chat.get("tools"), "tools")
    if tools:
        out["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    choice = chat.get("tool_choice")
    if choice is not None:
        out["tool_choice"] = _tool_choice(choice)
    return out


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise _bad("tools", f"has a tool of type {tool.get('type')!r}")
    fn = _object(tool.get("function"), f"{where}.function")
    out = {"name": fn.get("name"), "input_schema": fn.get("parameters") or {"type": "object"}}
    if fn.get("description"):
        out["description"] = fn["description"]
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    if isinstance(choice, str) and choice in _CHOICE:
        return dict(_CHOICE[choice])
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {
            "type": "tool",
            "name": _object(choice.get("function"), "tool_choice.function").get("name"),
        }
    raise _bad("tool_choice", f"is {choice!r}")
