"""An Anthropic Messages request written as an OpenAI chat completion request (see
messages_via_chat.py): what both APIs express is translated, what chat cannot express is a
400 naming the field. `cache_control` marks are a caching hint, not content: they go (an
OpenAI upstream caches prefixes by itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from tokenpipe.errors import GatewayError, dumps_request

#: Messages fields chat has no counterpart for: refused, naming the field.
UNSUPPORTED = ("top_k", "container", "mcp_servers")
#: Anthropic's tool choices as chat's.
_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


def _bad(field: str, why: str) -> GatewayError:
    return GatewayError(
        400,
        f"`{field}` {why}: the model's upstream speaks OpenAI's chat API, which cannot express it.",
        param=field,
        code="invalid_request",
    )


def _image(block: dict[str, Any]) -> dict[str, Any]:
    src = block.get("source")
    if not isinstance(src, dict):
        raise GatewayError(
            400,
            "An image block's `source` must be an object.",
            param="messages",
            code="invalid_request",
        )
    if src.get("type") == "base64":
        url = f"data:{src.get('media_type')};base64,{src.get('data')}"
    elif src.get("type") == "url":
        url = str(src.get("url"))
    else:
        raise _bad("messages", f"has an image source of type {src.get('type')!r}")
    return {"type": "image_url", "image_url": {"url": url}}


def _text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):  # a number or `true` (was a 500)
        raise _bad(field, f"has content of type {type(content).__name__} where text fits")
    out = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(field, f"has a block of type {kind!r} where only text fits")
        out.append(str(block.get("text") or ""))
    return "".join(out)


def _user(content: Any, out: list[dict[str, Any]]) -> None:
    """A user turn: its tool results become `tool` messages (first, as chat wants them right
    after the assistant's calls), its text and images one user message."""
    if isinstance(content, str):
        out.append({"role": "user", "content": content})
        return
    parts: list[dict[str, Any]] = []
    for block in content or ():
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            if block.get("is_error"):
                raise _bad("messages", "has a tool_result with is_error")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": _text(block.get("content"), "messages"),
                }
            )
        elif kind == "text":
            parts.append({"type": "text", "text": str(block.get("text") or "")})
        elif kind == "image":
            parts.append(_image(block))
        else:
            raise _bad("messages", f"has a user block of type {kind!r}")
    if parts:
        out.append({"role": "user", "content": parts})


def _assistant(content: Any, out: list[dict[str, Any]]) -> None:
    if isinstance(content, str):
        out.append({"role": "assistant", "content": content})
        return
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content or ():
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(str(block.get("text") or ""))
        elif kind == "tool_use":
            calls.append(tool_call(block, dumps_request))
        else:
            raise _bad("messages", f"has an assistant block of type {kind!r}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    out.append(message)


def tool_call(
    block: dict[str, Any], write: Callable[[Any], bytes] = orjson.dumps
) -> dict[str, Any]:
    """A Messages `tool_use` block as a chat tool call (its input as JSON arguments, written
    by `write`: a client's block by `dumps_request`, whose failure is the client's 400; an
    upstream's by orjson, whose failure, a TypeError, is the upstream's protocol error)."""
    arguments = write(block.get("input") or {}).decode()
    return {
        "id": block.get("id"),
        "type": "function",
        "function": {"name": block.get("name"), "arguments": arguments},
    }


def chat_request(messages_req: dict[str, Any]) -> dict[str, Any]:
    """A Messages request as a chat completion request (400 for what chat cannot express)."""
    for field in UNSUPPORTED:
        if messages_req.get(field) is not None:
            raise _bad(field, "is set")
    thinking = messages_req.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        raise _bad("thinking", "asks for extended thinking")
    messages: list[dict[str, Any]] = []
    system = messages_req.get("system")
    if system:
        messages.append({"role": "system", "content": _text(system, "system")})
    for m in messages_req.get("messages") or ():
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            _user(m.get("content"), messages)
        elif role == "assistant":
            _assistant(m.get("content"), messages)
        else:
            raise _bad("messages", f"has a message with role {role!r}")
    out: dict[str, Any] = {
        "model": messages_req.get("model"),
        "messages": messages,
        "max_tokens": messages_req.get("max_tokens"),
    }
    for field in ("temperature", "top_p"):
        if messages_req.get(field) is not None:
            out[field] = messages_req[field]
    if messages_req.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}  # Messages always reports usage
    stop = messages_req.get("stop_sequences")
    if stop:
        out["stop"] = list(stop)
    user = (messages_req.get("metadata") or {}).get("user_id")
    if user:
        out["user"] = str(user)
    tools = messages_req.get("tools")
    if tools:
        out["tools"] = [_tool(t) for t in tools]
    choice = messages_req.get("tool_choice")
    if choice is not None:
        out["tool_choice"] = _tool_choice(choice)
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom") or "input_schema" not in tool:
        raise _bad("tools", f"has a server tool {tool.get('name') or tool.get('type')!r}")
    fn: dict[str, Any] = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description"):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind in _CHOICE:  # a list or an object is no key
        return _CHOICE[kind]
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise _bad("tool_choice", f"is {choice!r}")
