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


def _image(part: dict[str, Any]) -> dict[str, Any]:
    url = (part.get("image_url") or {}).get("url")
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
    for m in chat.get("messages") or ():
        role = m.get("role")
        if role in ("system", "developer"):
            system.append(_text_of(m.get("content")))
        elif role == "user":
            messages.append({"role": "user", "content": _blocks(m.get("content"))})
        elif role == "assistant":
            blocks = _blocks(m.get("content"))
            for call in m.get("tool_calls") or ():
                fn = call.get("function") or {}
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
        out["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if chat.get("user"):
        out["metadata"] = {"user_id": str(chat["user"])}
    tools = chat.get("tools")
    if tools:
        out["tools"] = [_tool(t) for t in tools]
    choice = chat.get("tool_choice")
    if choice is not None:
        out["tool_choice"] = _tool_choice(choice)
    return out


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise _bad("tools", f"has a tool of type {tool.get('type')!r}")
    fn = tool.get("function") or {}
    out = {"name": fn.get("name"), "input_schema": fn.get("parameters") or {"type": "object"}}
    if fn.get("description"):
        out["description"] = fn["description"]
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    if isinstance(choice, str) and choice in _CHOICE:
        return dict(_CHOICE[choice])
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "tool", "name": (choice.get("function") or {}).get("name")}
    raise _bad("tool_choice", f"is {choice!r}")
